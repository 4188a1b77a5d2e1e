"""The contract every sketched layer shares (SketchedLayer): read-only ``weight``, fitting from a
dense layer and its validation, float16 range, and clear errors — checked on all four layers."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

from panther_lite.nn import SketchedLayer, SKConv1d, SKConv2d, SKConv3d, SKLinear

pytestmark = pytest.mark.filterwarnings("ignore:.*more than the dense layer:UserWarning")

# kind: (dense factory, sketched class, input shape without batch)
KINDS = {
    "linear": (lambda **kw: nn.Linear(12, 10, **kw), SKLinear, (12,)),
    "conv1d": (lambda **kw: nn.Conv1d(3, 6, 3, padding=1, **kw), SKConv1d, (3, 9)),
    "conv2d": (lambda **kw: nn.Conv2d(3, 6, 3, padding=1, **kw), SKConv2d, (3, 7, 6)),
    "conv3d": (lambda **kw: nn.Conv3d(3, 6, 3, padding=1, **kw), SKConv3d, (3, 4, 5, 4)),
}


def make(kind, dtype=torch.float64, L=1, k=2, **kwargs):
    """(dense layer, sketched layer fitted from it, input batch)."""
    torch.manual_seed(0)
    factory, cls, shape = KINDS[kind]
    dense = factory(dtype=dtype)
    layer = cls.from_dense(dense, L, k, **kwargs)
    return dense, layer, torch.randn(2, *shape, dtype=dtype)


def state(layer):
    return {name: tensor.clone() for name, tensor in layer.state_dict().items()}


def assert_unchanged(layer, before):
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name]), name


# ------------------------------------------------------------------ read-only weight


@pytest.mark.parametrize("kind", KINDS)
def test_weight_is_the_effective_weight_in_the_dense_layout_and_differentiable(kind):
    dense, layer, _ = make(kind)
    assert isinstance(layer, SketchedLayer)
    weight = layer.weight
    assert weight.shape == dense.weight.shape and weight.dtype == dense.weight.dtype
    torch.testing.assert_close(weight, layer.effective_weight(), rtol=0, atol=0)
    assert weight.requires_grad  # grad mode on and the factors train
    trainable = [p for p in layer.parameters() if p is not layer.bias]
    grads = torch.autograd.grad(weight.square().sum(), trainable)
    want = torch.autograd.grad(layer.effective_weight().square().sum(), trainable)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_outside_autograd_is_reused_until_the_factors_change(kind):
    _, layer, x = make(kind)

    def kept():
        return layer.__dict__["_weight_cache"][1]

    with torch.no_grad():
        first = layer.weight
        assert kept() is not first and torch.equal(layer.weight, first) and not first.requires_grad
        product = kept()
        layer.weight
        assert kept() is product  # reused: no new product
        next(layer.parameters()).mul_(2)  # in-place write: version counter moves
        second = layer.weight
        assert kept() is not product and not torch.equal(second, first)
        torch.testing.assert_close(second, layer.effective_weight(), rtol=0, atol=0)
        product = kept()
        layer.load_state_dict(state(layer))  # copy_ into every factor
        layer.weight
        assert kept() is not product
        layer(x)  # the forward frees it
        assert "_weight_cache" not in layer.__dict__


@pytest.mark.parametrize("fused", [False, True])
def test_weight_sees_every_optimizer_step_fused_included(fused):
    _, layer, x = make("linear", dtype=torch.float32)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=fused)
    with torch.no_grad():
        before = layer.weight
    layer(x).square().sum().backward()
    optimizer.step()  # fused Adam does not bump version counters
    with torch.no_grad():
        after = layer.weight
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, layer.effective_weight(), rtol=0, atol=0)


def test_weight_follows_casts_and_parameter_only_casts():
    _, layer, _ = make("conv2d", dtype=torch.float32)
    with torch.no_grad():
        assert layer.weight.dtype == torch.float32
        assert layer.to(torch.float64).weight.dtype == torch.float64
        # FSDP2-style MixedPrecisionPolicy: parameters cast, buffers not
        layer.S = nn.Parameter(layer.S.to(torch.bfloat16))
        assert layer.weight.dtype == torch.bfloat16
        torch.testing.assert_close(layer.weight, layer.effective_weight(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_cannot_be_set_and_is_not_state(kind):
    _, layer, _ = make(kind)
    for value in (torch.zeros(layer.dense_weight_shape), nn.Parameter(torch.zeros(layer.dense_weight_shape))):
        with pytest.raises(AttributeError, match="weight is read-only.*initialize_from_weight"):
            layer.weight = value
    assert "weight" not in layer.state_dict()
    assert "weight" not in dict(layer.named_parameters()) and "weight" not in dict(layer.named_buffers())


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_and_pickle_keep_the_function_and_drop_the_cache(kind):
    _, layer, x = make(kind)
    with torch.no_grad():
        layer.weight
    assert "_weight_cache" in layer.__dict__
    clone = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        assert "_weight_cache" not in other.__dict__
        torch.testing.assert_close(other(x), layer(x), rtol=0, atol=0)
        torch.testing.assert_close(other.weight, layer.weight, rtol=0, atol=0)


class T5StyleFeedForward(nn.Module):
    """T5's FFN reads ``self.wo.weight.dtype`` to cast its hidden states."""

    def __init__(self, wo: nn.Module) -> None:
        super().__init__()
        self.wo = wo

    def forward(self, hidden):
        if isinstance(self.wo.weight, torch.Tensor) and hidden.dtype != self.wo.weight.dtype:
            hidden = hidden.to(self.wo.weight.dtype)
        return self.wo(hidden)


def test_code_reading_weight_dtype_works_eager_and_compiled():
    dense, layer, x = make("linear", dtype=torch.float32)
    model = T5StyleFeedForward(layer)
    want = T5StyleFeedForward(layer.to_dense())(x.double())
    got = model(x.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x.double()), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_multihead_attention_with_a_sketched_out_proj(training):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
    mha.out_proj = SKLinear.from_linear(mha.out_proj, 1, 4)
    twin = copy.deepcopy(mha)
    twin.out_proj = mha.out_proj.to_dense()
    mha.train(training), twin.train(training)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.set_grad_enabled(training):
        got, want = mha(x, x, x)[0], twin(x, x, x)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if training:
        got.sum().backward()
        assert mha.out_proj.S1.grad is not None and mha.out_proj.S2.grad is not None


def test_torchscript_says_it_is_unsupported_and_what_to_use():
    for module in (make("linear")[1], nn.Sequential(nn.ReLU(), make("conv2d")[1])):
        with pytest.raises(RuntimeError, match=r"torch.jit.script does not support.*torch.compile.*torch.export"):
            torch.jit.script(module)


# ------------------------------------------------------------------ fitting and its validation


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_raise_before_anything_changes(kind, bad):
    dense, layer, _ = make(kind)
    before = state(layer)
    with torch.no_grad():
        dense.weight.view(-1)[3] = bad
    count = "1 NaN, 0 Inf" if bad != bad else "0 NaN, 1 Inf"
    with pytest.raises(ValueError, match=f"weight contains non-finite values \\({count}"):
        type(layer).from_dense(dense, 1, 2)
    with pytest.raises(ValueError, match=count):
        layer.initialize_from_weight(dense.weight)
    assert_unchanged(layer, before)


def test_non_finite_w_init_and_layer_arguments_raise():
    weight = torch.randn(10, 12)
    weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"W_init contains non-finite values \(0 NaN, 1 Inf"):
        SKLinear(12, 10, 1, 2, W_init=weight)
    conv = nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        conv.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer.weight contains non-finite values \(1 NaN"):
        SKConv2d(3, 4, 3, num_terms=1, low_rank=2, layer=conv)


def test_meta_device_weights_say_what_to_do():
    meta_weight = torch.empty(10, 12, device="meta")
    with pytest.raises(ValueError, match="W_init is on the meta device.*materialise.*state_dict"):
        SKLinear(12, 10, 1, 2, W_init=meta_weight)
    with pytest.raises(ValueError, match="meta device"):
        SKLinear.from_linear(nn.Linear(12, 10, device="meta"), 1, 2)
    with pytest.raises(ValueError, match="meta device"):
        SKConv3d.from_conv3d(nn.Conv3d(3, 4, 3, device="meta"), 1, 2)
    on_meta = SKLinear(12, 10, 1, 2, W_init=meta_weight, device="meta")  # shapes only: nothing to fit
    assert on_meta.S1.is_meta
    real = SKLinear(12, 10, 1, 2, seed=0)
    on_meta.to_empty(device="cpu").load_state_dict(real.state_dict())
    torch.testing.assert_close(on_meta.weight, real.weight)


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_calibration_grams_are_rejected_with_a_reason(kind):
    dense, layer, _ = make(kind)
    before = state(layer)
    fan_in = layer.fan_in
    x = torch.randn(4 * fan_in, fan_in, dtype=torch.float64)
    gram = x.t() @ x
    indefinite = gram - 2 * torch.linalg.eigvalsh(gram)[-1] * torch.outer(x[0], x[0]) / x[0].dot(x[0])
    asymmetric = gram.clone()
    asymmetric[0, 1] += gram.diagonal().mean()
    non_finite = gram.clone()
    non_finite[2, 2] = float("nan")
    for bad, reason in ((indefinite, "not positive semi-definite"), (asymmetric, "not symmetric"),
                        (non_finite, "non-finite")):
        with pytest.raises(ValueError, match=reason):
            type(layer).from_dense(dense, 1, 2, gram=bad)
        with pytest.raises(ValueError, match=reason):
            layer.initialize_from_weight(dense.weight, gram=bad)
    assert_unchanged(layer, before)
    rounded = (x.float().t() @ x.float()).double()  # float32 accumulation is within tolerance
    type(layer).from_dense(dense, 1, 2, gram=rounded)


def test_fit_method_reaches_the_decomposition(monkeypatch):
    import panther_lite.nn.skconv as skconv
    import panther_lite.nn.linear_factors as sklinear

    seen = []
    for module, name in ((sklinear, "sketch_factors_from_weight"), (skconv, "output_subspace")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **kw: seen.append(kw) or _real(*a, **kw))
    SKLinear.from_linear(nn.Linear(12, 10), 1, 2, fit="randomized", seed=4)
    SKConv1d.from_conv1d(nn.Conv1d(3, 6, 3), 1, 2, fit="exact")
    assert seen == [{"output_gram": None, "method": "randomized", "seed": 4}, {"method": "exact", "seed": None}]
    with pytest.raises(ValueError, match="fit must be one of"):
        SKConv2d.from_conv2d(nn.Conv2d(3, 6, 3), 1, 2, fit="fast")


@pytest.mark.parametrize("kind", KINDS)
def test_float16_layers_with_large_outputs_stay_finite(kind):
    # Outputs up to ~6000 fit float16 (max 65504); with 2L = 16 the factor 2L must not sit in
    # an intermediate such as x·S1 or conv(x, S), or those overflow.
    torch.manual_seed(0)
    factory, cls, shape = KINDS[kind]
    dense = factory(dtype=torch.float32)
    x = torch.randn(16, *shape)
    with torch.no_grad():
        dense.weight.mul_(6000 / dense(x).abs().max())
    dense = dense.half()
    want = dense(x.half())
    assert torch.isfinite(want).all() and want.abs().max() > 4000
    full_rank = min(dense.weight.shape[0], dense.weight[0].numel())
    layer = cls.from_dense(dense, 8, -(-full_rank // 16))  # 2Lk >= rank: exact in exact arithmetic
    got = layer(x.half())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-3 * want.abs().max().item())


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize("kind", KINDS)
def test_zero_dim_input_raises_naming_the_expected_shape(kind):
    _, layer, _ = make(kind)
    with pytest.raises(ValueError, match=r"got shape \(\)"):
        layer(torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["conv1d", "conv2d", "conv3d"])
def test_conv_input_dtype_mismatch_says_what_to_do_like_sklinear(kind):
    _, layer, x = make(kind, dtype=torch.float32)
    with pytest.raises(TypeError, match="S has dtype torch.float32 but the input has torch.float64; cast one"):
        layer(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", KINDS)
def test_from_dense_rejects_other_layer_types_and_to_dense_leaves_the_global_rng_alone(kind):
    _, layer, x = make(kind)
    with pytest.raises(TypeError, match=f"converts an nn.{type(layer.to_dense()).__name__}, got ReLU"):
        type(layer).from_dense(nn.ReLU(), 1, 2)
    torch.manual_seed(5)
    dense = layer.to_dense()
    assert torch.equal(torch.rand(3), torch.manual_seed(5) and torch.rand(3))
    torch.testing.assert_close(dense(x), layer(x), rtol=1e-12, atol=1e-12)


def test_size_warning_names_the_layer_configuration():
    with pytest.warns(UserWarning, match=r"SKConv1d\(4, 4, kernel_size=\(3,\).*more than the dense"):
        SKConv1d(4, 4, 3, num_terms=2, low_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SKConv3d(16, 16, 3, num_terms=1, low_rank=4)
