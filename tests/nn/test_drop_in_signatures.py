"""Drop-in signatures: SKLinear and SKConv1d/2d/3d take nn.Linear's / nn.ConvNd's arguments
in their order with their defaults, so swapping a dense layer for its sketched twin keeps
every call and every output shape."""
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import SKConv1d, SKConv2d, SKConv3d, SKLinear

PAIRS = {1: (SKConv1d, nn.Conv1d), 2: (SKConv2d, nn.Conv2d), 3: (SKConv3d, nn.Conv3d)}
SKETCH_KEYWORDS = ["num_terms", "low_rank", "layer", "init", "seed"]


def _shared_prefix(sketched: type, dense: type):
    """``(sketched parameters, dense parameters)`` restricted to the names both have, in order."""
    ours = inspect.signature(sketched).parameters
    theirs = inspect.signature(dense).parameters
    shared = [name for name in theirs if name in ours]
    return [ours[n] for n in shared], [theirs[n] for n in shared], ours, theirs


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_signature_is_nn_convs_then_keyword_only_sketch_arguments(dims):
    sketched, dense = PAIRS[dims]
    ours = list(inspect.signature(sketched).parameters.values())
    theirs = list(inspect.signature(dense).parameters.values())
    head = ours[: len(theirs)]
    assert [p.name for p in head] == [p.name for p in theirs]
    assert [p.default for p in head] == [p.default for p in theirs]
    assert [p.kind for p in head] == [p.kind for p in theirs]
    assert inspect.signature(sketched).parameters["kernel_size"].default is inspect.Parameter.empty
    tail = ours[len(theirs):]
    assert [p.name for p in tail] == SKETCH_KEYWORDS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in tail)
    assert [p.default for p in tail][:2] == [6, 8]


def test_linear_shares_nn_linears_parameters_in_order_with_its_defaults():
    ours, theirs, all_ours, _ = _shared_prefix(SKLinear, nn.Linear)
    assert [p.name for p in theirs] == ["in_features", "out_features", "bias", "device", "dtype"]
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert [p.default for p in ours] == [p.default for p in theirs]
    names = list(all_ours)
    assert [names.index(p.name) for p in ours] == sorted(names.index(p.name) for p in ours)
    assert names[:5] == ["in_features", "out_features", "num_terms", "low_rank", "W_init"]
    assert all(all_ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("init", "seed"))


def test_linear_takes_device_before_dtype_positionally():
    layer = SKLinear(8, 4, 1, 2, None, False, "cpu", torch.float64)
    assert layer.S1.dtype == torch.float64 and layer.bias is None


def test_conv_positional_call_of_nn_conv_builds_the_same_configuration():
    args = (3, 4, (3, 2), (2, 1), (1, 0), (1, 2), 1, False, "reflect", "cpu", torch.float64)
    sketched, dense = SKConv2d(*args, num_terms=1, low_rank=2), nn.Conv2d(*args)
    for name in ("kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
        assert getattr(sketched, name) == getattr(dense, name), name
    assert sketched.bias is None and sketched.S.dtype == torch.float64


def test_conv_requires_kernel_size_like_nn_conv():
    for cls in (SKConv1d, SKConv2d, SKConv3d):
        with pytest.raises(TypeError, match="kernel_size"):
            cls(3, 4, num_terms=1, low_rank=2)


@st.composite
def conv_arguments(draw):
    """A valid ``nn.ConvNd`` argument set (``groups=1``, what the sketched layers support),
    split at random between positional and keyword arguments, and an input large enough."""
    dims = draw(st.sampled_from([1, 2, 3]))
    side = st.integers(1, 3) if dims == 3 else st.integers(1, 4)

    def per_dim(strategy):
        return draw(st.one_of(strategy, st.tuples(*[strategy] * dims)))

    kernel = per_dim(side)
    stride = per_dim(st.integers(1, 3))
    dilation = per_dim(st.integers(1, 2))
    if stride == 1 or stride == (1,) * dims:
        padding = draw(st.one_of(st.sampled_from(["same", "valid"]), st.integers(0, 2)))
    else:
        padding = draw(st.one_of(st.just("valid"), st.integers(0, 2)))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    values = [draw(st.integers(1, 4)), draw(st.integers(1, 5)), kernel, stride, padding, dilation, 1,
              draw(st.booleans()), padding_mode]
    names = ["in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
             "padding_mode"]
    split = draw(st.integers(3, len(values)))
    keywords = {n: v for n, v in zip(names[split:], values[split:]) if draw(st.booleans())}
    kernel_sizes = kernel if isinstance(kernel, tuple) else (kernel,) * dims
    dilations = dilation if isinstance(dilation, tuple) else (dilation,) * dims
    spatial = tuple(d * (k - 1) + draw(st.integers(3, 6)) for k, d in zip(kernel_sizes, dilations))
    batch = draw(st.sampled_from([(), (2,)]))
    return dims, tuple(values[:split]), keywords, batch + (values[0],) + spatial


@settings(max_examples=60, deadline=None)
@given(conv_arguments())
def test_same_arguments_give_the_same_output_shape_as_nn_conv(case):
    dims, args, kwargs, input_shape = case
    sketched_cls, dense_cls = PAIRS[dims]
    dense = dense_cls(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # some tiny layers store more than dense
        sketched = sketched_cls(*args, **kwargs, num_terms=1, low_rank=1, seed=0)
    x = torch.randn(input_shape)
    with torch.no_grad():
        assert sketched(x).shape == dense(x).shape


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.booleans(), st.lists(st.integers(1, 3), max_size=2))
def test_same_arguments_give_the_same_output_shape_as_nn_linear(fan_in, fan_out, bias, leading):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sketched = SKLinear(fan_in, fan_out, 1, 1, None, bias, "cpu", torch.float32)
    dense = nn.Linear(fan_in, fan_out, bias, "cpu", torch.float32)
    x = torch.randn(*leading, fan_in)
    with torch.no_grad():
        assert sketched(x).shape == dense(x).shape
    assert (sketched.bias is None) == (dense.bias is None)
