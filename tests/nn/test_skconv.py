"""The sketched conv family (SKConv1d/2d/3d) against nn.Conv*d / F.conv*d references, plus its contract."""
import copy
import inspect
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import SKConv1d, SKConv2d, SKConv3d, conv_sketch_size

pytestmark = pytest.mark.filterwarnings("ignore:.*more than the dense layer:UserWarning")

FAMILY = {1: (SKConv1d, nn.Conv1d, F.conv1d), 2: (SKConv2d, nn.Conv2d, F.conv2d), 3: (SKConv3d, nn.Conv3d, F.conv3d)}
FROM_DENSE = {1: "from_conv1d", 2: "from_conv2d", 3: "from_conv3d"}


def make_layer(c_in, c_out, L=2, k=3, dtype=torch.float64, seed=0, dims=2, kernel_size=3, padding=1, **kwargs):
    """A layer with random S (so tests do not depend on how S was initialised)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        layer = FAMILY[dims][0](
            c_in, c_out, kernel_size, padding=padding, num_terms=L, low_rank=k, dtype=dtype, seed=seed, **kwargs
        )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        layer.S.copy_(torch.randn(layer.S.shape, generator=gen, dtype=dtype))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen, dtype=dtype))
    return layer


def per_term_kernel(layer) -> torch.Tensor:
    """The anchor's formula term by term: 1/(2L) Σ_i U_iᵀ S_i, as (C_out, C_in, *kernel_size)."""
    terms = [torch.einsum("ko,kc...->oc...", layer.Us[i], layer.Ss[i]) for i in range(2 * layer.num_terms)]
    return sum(terms) / (2 * layer.num_terms)


def reference_conv(layer) -> nn.Module:
    """An independently built nn.Conv*d with the layer's options and per-term kernel."""
    conv = FAMILY[len(layer.kernel_size)][1](
        layer.in_channels,
        layer.out_channels,
        layer.kernel_size,
        stride=layer.stride,
        padding=layer.padding,
        dilation=layer.dilation,
        bias=layer.bias is not None,
        padding_mode=layer.padding_mode,
        dtype=layer.S.dtype,
    )
    with torch.no_grad():
        conv.weight.copy_(per_term_kernel(layer))
        if layer.bias is not None:
            conv.bias.copy_(layer.bias)
    return conv


def truncated(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]


def test_effective_weight_is_the_per_term_sum():
    layer = make_layer(3, 5, L=2, k=2, kernel_size=(2, 3))
    torch.testing.assert_close(layer.effective_weight(), per_term_kernel(layer), rtol=1e-13, atol=1e-13)
    assert layer.S.shape == (8, 3, 2, 3) and layer.U.shape == (8, 5)
    assert layer.Ss.shape == (4, 2, 3, 2, 3) and layer.Us.shape == (4, 2, 5)
    assert layer.Ss.data_ptr() == layer.S.data_ptr() and layer.Us.data_ptr() == layer.U.data_ptr()


PADDINGS = st.one_of(
    st.sampled_from(["same", "valid"]),
    st.integers(0, 2),
    st.tuples(st.integers(0, 2), st.integers(0, 2)),
)


@settings(max_examples=60, deadline=None)
@given(
    kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=PADDINGS,
    padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
    bias=st.booleans(),
    batched=st.booleans(),
    size=st.tuples(st.integers(7, 10), st.integers(7, 10)),
)
def test_forward_equals_nn_conv2d_for_every_option_float64(
    kernel, stride, dilation, padding, padding_mode, bias, batched, size
):
    if padding == "same":
        stride = (1, 1)
    layer = make_layer(
        3,
        4,
        L=1,
        k=2,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        bias=bias,
        padding_mode=padding_mode,
    )
    x = torch.randn(*((2,) if batched else ()), 3, *size, dtype=torch.float64)
    want = reference_conv(layer)(x)
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", [2, 4, (2, 3)])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_same_padding_of_even_kernels_is_asymmetric_like_f_conv2d(kernel, dilation, padding_mode):
    layer = make_layer(
        2, 3, L=1, k=2, kernel_size=kernel, padding="same", dilation=dilation, padding_mode=padding_mode
    )
    x = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    want = reference_conv(layer)(x)
    assert want.shape[-2:] == x.shape[-2:]
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    if padding_mode == "zeros":
        plain = F.conv2d(x, layer.effective_weight(), layer.bias, padding="same", dilation=dilation)
        torch.testing.assert_close(want, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_backward_matches_dense_autograd_float64(bias, padding_mode):
    layer = make_layer(3, 4, L=2, k=2, stride=2, bias=bias, padding_mode=padding_mode)
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64, requires_grad=True)
    params = [p for p in (layer.S, layer.bias) if p is not None]
    y = layer(x)
    grad_out = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], grad_out)
    conv = reference_conv(layer)
    if padding_mode == "zeros":
        ref = F.conv2d(x, layer.effective_weight(), layer.bias, stride=2, padding=1)
    else:
        ref = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), layer.effective_weight(), layer.bias, stride=2)
    torch.testing.assert_close(ref, conv(x), rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(ref, [x, *params], grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert layer.U.grad is None and not layer.U.requires_grad


def test_channels_last_input_gives_same_result_and_stays_channels_last():
    layer = make_layer(4, 6, L=1, k=3, dtype=torch.float32)
    x = torch.randn(2, 4, 10, 9)
    x_cl = x.to(memory_format=torch.channels_last)
    y, y_cl = layer(x), layer(x_cl)
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    assert y.is_contiguous()
    torch.testing.assert_close(y_cl, y, rtol=1e-5, atol=1e-5)
    y_cl.sum().backward()
    grad_cl = layer.S.grad.clone()
    layer.S.grad = None
    y.sum().backward()
    torch.testing.assert_close(grad_cl, layer.S.grad, rtol=1e-4, atol=1e-4)


def test_svd_init_is_the_truncated_svd_of_the_unfolding():
    conv = nn.Conv2d(5, 12, 3, dtype=torch.float64)
    L, k = 1, 3
    layer = SKConv2d.from_conv2d(conv, L, k)
    unfolding = conv.weight.detach().reshape(12, -1)
    want = truncated(unfolding, 2 * L * k).view_as(conv.weight)
    torch.testing.assert_close(layer.effective_weight(), want, rtol=1e-10, atol=1e-10)
    # U = 2L·Qᵀ with orthonormal Q: the factor 2L sits in the fixed sketch, not in S.
    basis_t = layer.U / (2 * L)
    torch.testing.assert_close(basis_t @ basis_t.t(), torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-12)
    assert layer.init == "svd" and layer.padding == conv.padding


def test_calibrated_svd_reaches_the_optimal_output_error():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 10, 3, padding=1, dtype=torch.float64)
    mixing = torch.randn(4, 4, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.1, 0.01], dtype=torch.float64)
    x = torch.einsum("dc,nchw->ndhw", mixing, torch.randn(6, 4, 8, 8, dtype=torch.float64))
    patches = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(-1, 36)
    gram = patches.t() @ patches
    L, k = 1, 2
    plain = SKConv2d.from_conv2d(conv, L, k)
    calibrated = SKConv2d.from_conv2d(conv, L, k, gram=gram)
    with torch.no_grad():
        exact = conv(x)
        plain_error = (plain(x) - exact).norm()
        calibrated_error = (calibrated(x) - exact).norm()
    outputs = patches @ conv.weight.detach().reshape(10, -1).t()
    optimal_error = torch.linalg.svdvals(outputs)[2 * L * k :].norm()
    assert calibrated_error < 0.9 * plain_error
    torch.testing.assert_close(calibrated_error, optimal_error, rtol=2e-3, atol=0)
    torch.testing.assert_close(calibrated.bias, conv.bias)


def test_sketch_init_error_matches_theory_and_is_unbiased():
    c_in, c_out, L, k = 6, 64, 2, 4
    weight = torch.randn(c_out, c_in, 3, 3, dtype=torch.float64)
    conv = nn.Conv2d(c_in, c_out, 3, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(weight)
    estimates = [
        SKConv2d.from_conv2d(conv, L, k, init="sketch", seed=s).effective_weight().detach() for s in range(64)
    ]
    # Each term's U_iᵀU_i − I has zero diagonal and off-diagonal variance 1/k.
    theory = math.sqrt((c_out - 1) / (2 * L * k))
    single = torch.stack([((e - weight).norm() / weight.norm()) ** 2 for e in estimates]).mean().sqrt()
    assert abs(single.item() / theory - 1) < 0.15
    averaged = torch.stack(estimates).mean(0)
    assert ((averaged - weight).norm() / weight.norm()).item() < 1.5 * theory / math.sqrt(len(estimates))


def test_seed_reproduces_sketches_with_per_term_scale():
    a = SKConv2d(4, 16, 3, num_terms=2, low_rank=2, seed=7)
    b = SKConv2d(4, 16, 3, num_terms=2, low_rank=2, seed=7)
    c = SKConv2d(4, 16, 3, num_terms=2, low_rank=2, seed=8)
    assert torch.equal(a.U, b.U)
    assert not torch.equal(a.U, c.U)
    torch.testing.assert_close(a.U.abs(), torch.full_like(a.U, 1 / math.sqrt(2)))
    conv = nn.Conv2d(4, 16, 3)
    first = SKConv2d.fromTorch(conv, 2, 2)
    assert first.init == "sketch"
    torch.manual_seed(3)
    u1 = SKConv2d.from_conv2d(conv, 2, 2, init="sketch").U
    torch.manual_seed(3)
    u2 = SKConv2d.from_conv2d(conv, 2, 2, init="sketch").U
    assert torch.equal(u1, u2)


@pytest.mark.parametrize("init", ["sketch", "svd"])
def test_default_init_has_conv2d_scale_and_seed_reproduces_everything(init):
    c_in, c_out = 16, 24
    layer = SKConv2d(c_in, c_out, 3, num_terms=1, low_rank=2, init=init, seed=0)
    rms = layer.effective_weight().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1 / math.sqrt(3 * c_in * 9), rel=1e-5)  # nn.Conv2d's U(±1/√fan_in)
    assert layer.bias.abs().max() <= 1 / math.sqrt(c_in * 9)
    again = SKConv2d(c_in, c_out, 3, num_terms=1, low_rank=2, init=init, seed=0)
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_to_dense_and_from_conv2d_round_trip():
    conv = nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), padding_mode="replicate")
    conv = conv.double()
    layer = SKConv2d.from_conv2d(conv, 1, 2)  # 2Lk = 4 = C_out: exact
    x = torch.randn(2, 3, 9, 10, dtype=torch.float64)
    torch.testing.assert_close(layer(x), conv(x), rtol=1e-10, atol=1e-10)
    assert (layer.stride, layer.dilation, layer.padding_mode) == ((2, 1), (1, 2), "replicate")
    assert layer.S.dtype == torch.float64
    dense = layer.to_dense()
    assert isinstance(dense, nn.Conv2d) and dense.weight.dtype == torch.float64
    assert (dense.stride, dense.padding, dense.dilation, dense.padding_mode) == ((2, 1), (1, 0), (1, 2), "replicate")
    torch.testing.assert_close(dense(x), layer(x), rtol=1e-12, atol=1e-12)
    no_bias = SKConv2d.from_conv2d(nn.Conv2d(3, 4, 3, bias=False), 1, 2)
    assert no_bias.bias is None and no_bias.to_dense().bias is None


def test_layer_argument_initialises_from_a_conv():
    conv = nn.Conv2d(3, 4, 3, dtype=torch.float64)
    layer = SKConv2d(3, 4, 3, num_terms=1, low_rank=2, layer=conv, dtype=torch.float64, init="svd")
    torch.testing.assert_close(layer.effective_weight(), conv.weight, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.bias, conv.bias)
    with pytest.raises(ValueError, match="bias"):
        SKConv2d(3, 4, 3, num_terms=1, low_rank=2, layer=nn.Conv2d(3, 4, 3, bias=False))
    with pytest.raises(ValueError, match=r"\(4, 3, 3, 3\)"):
        SKConv2d(3, 4, 3, num_terms=1, low_rank=2, layer=nn.Conv2d(3, 4, 5))
    with pytest.raises(TypeError, match="nn.Conv2d"):
        SKConv2d(3, 4, 3, num_terms=1, low_rank=2, layer=nn.Linear(3, 4))


def test_groups_and_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="groups=1"):
        SKConv2d(4, 4, 3, groups=2, num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="groups=1"):
        SKConv2d.from_conv2d(nn.Conv2d(4, 4, 3, groups=2), 1, 1)
    with pytest.raises(ValueError, match="strided"):
        SKConv2d(4, 4, 3, padding="same", stride=2, num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="padding_mode"):
        SKConv2d(4, 4, 3, padding_mode="mirror", num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="padding"):
        SKConv2d(4, 4, 3, padding="full", num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="padding"):
        SKConv2d(4, 4, 3, padding=-1, num_terms=1, low_rank=1)
    for arg in ("kernel_size", "stride", "dilation"):
        with pytest.raises(ValueError, match=arg):
            SKConv2d(4, 4, num_terms=1, low_rank=1, **{"kernel_size": 3, arg: 0})
    for arg in ("in_channels", "out_channels"):
        with pytest.raises(ValueError, match=arg):
            SKConv2d(**{"in_channels": 4, "out_channels": 4, "kernel_size": 3, arg: 0})
    for arg in ("num_terms", "low_rank"):
        with pytest.raises(ValueError, match=arg):
            SKConv2d(4, 4, 3, **{"num_terms": 1, "low_rank": 1, arg: 0})
    with pytest.raises(ValueError, match="init"):
        SKConv2d(4, 4, 3, num_terms=1, low_rank=1, init="random")
    with pytest.raises(TypeError, match="nn.Conv2d"):
        SKConv2d.from_conv2d(nn.Linear(3, 3), 1, 1)
    with pytest.raises(ValueError, match="init='svd'"):
        SKConv2d.from_conv2d(nn.Conv2d(3, 3, 3), 1, 1, init="sketch", gram=torch.eye(27))
    expected = r"gram must have shape \(C_in·kh·kw, C_in·kh·kw\) = \(27, 27\), got \(9, 9\)"
    with pytest.raises(ValueError, match=expected):
        SKConv2d.from_conv2d(nn.Conv2d(3, 3, 3), 1, 1, gram=torch.eye(9))


@pytest.mark.parametrize(
    "shape,match",
    [((2, 5, 8, 8), "C_in=4"), ((4, 8), "C_in=4"), ((1, 1, 4, 8, 8), "C_in=4"), ((5, 8, 8), "got shape \\(5, 8, 8\\)")],
)
def test_bad_input_raises_naming_what_was_expected(shape, match):
    layer = SKConv2d(4, 6, 3, num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(shape))


def test_failed_reinitialisation_changes_nothing():
    layer = make_layer(3, 4, L=1, k=2)
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(ValueError, match=r"\(4, 3, 3, 3\)"):
        layer.initialize_from_weight(torch.randn(4, 3, 2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="init='svd'"):
        layer.initialize_from_weight(torch.randn(4, 3, 3, 3), init="sketch", gram=torch.eye(27))
    with pytest.raises(ValueError, match=r"\(27, 27\)"):
        layer.initialize_from_weight(torch.randn(4, 3, 3, 3), gram=torch.eye(9))
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_parameter_counts_say_what_they_count_and_large_configs_warn():
    layer = SKConv2d(16, 32, 3, num_terms=1, low_rank=4)
    counts = layer.parameter_counts()
    assert counts.trainable == sum(p.numel() for p in layer.parameters()) == 8 * 16 * 9 + 32
    assert counts.stored == counts.trainable + sum(b.numel() for b in layer.buffers())
    assert counts == conv_sketch_size(16 * 9, 32, 1, 4, True)
    no_bias = SKConv2d(16, 32, 3, bias=False, num_terms=1, low_rank=4).parameter_counts()
    assert no_bias.trainable == 8 * 16 * 9
    with pytest.warns(UserWarning, match="more than the dense"):
        SKConv2d(4, 4, 3, num_terms=6, low_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SKConv2d(64, 64, 3, num_terms=1, low_rank=8)


def test_extra_repr_names_the_configuration():
    text = repr(SKConv2d(8, 16, 5, padding="same", padding_mode="reflect", bias=False, num_terms=1, low_rank=4))
    assert "8, 16, kernel_size=(5, 5), stride=(1, 1), padding='same', dilation=(1, 1)" in text
    assert "padding_mode='reflect', bias=False, num_terms=1, low_rank=4" in text


def test_state_dict_round_trip_and_deepcopy():
    layer = make_layer(3, 5, L=2, k=2)
    fresh = make_layer(3, 5, L=2, k=2, seed=99)
    assert set(layer.state_dict()) == {"S", "U", "bias"}
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    clone = copy.deepcopy(layer)
    torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_runs_low_precision_with_fp32_master_grads(dtype):
    layer = make_layer(8, 16, L=1, k=4, dtype=torch.float32)
    x = torch.randn(2, 8, 12, 12)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    want = F.conv2d(x.double(), layer.effective_weight().double(), layer.bias.double(), padding=1)
    torch.testing.assert_close(y.double(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    y.float().sum().backward()
    assert layer.S.grad.dtype == torch.float32 and torch.isfinite(layer.S.grad).all()


def test_to_dtype_runs_in_that_dtype():
    layer = make_layer(4, 6, L=1, k=2).to(torch.bfloat16)
    x = torch.randn(1, 4, 6, 6, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.U.dtype == torch.bfloat16
    want = F.conv2d(x.double(), layer.effective_weight().double(), layer.bias.double(), padding=1)
    torch.testing.assert_close(y.double(), want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_compile_fullgraph_equals_eager_forward_and_backward():
    layer = make_layer(3, 8, L=1, k=2, dtype=torch.float32, kernel_size=4, padding="same", padding_mode="reflect")
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    y_eager = layer(x)
    (gx_eager,) = torch.autograd.grad(y_eager.sum(), x)
    y_comp = compiled(x)
    (gx_comp,) = torch.autograd.grad(y_comp.sum(), x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_comp, gx_eager, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    layer = make_layer(3, 4, L=1, k=2)
    y = layer(torch.randn(0, 3, 5, 5, dtype=torch.float64))
    assert y.shape == (0, 4, 5, 5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_forward_backward_matches_float64_reference(dtype, tol, channels_last, monkeypatch):
    # cuDNN runs float32 convolutions in TF32 by default (10-bit mantissa: errors ~3e-4 of
    # the output's scale, several times the float32 tolerance); pin true float32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref_layer = make_layer(8, 16, L=2, k=4, kernel_size=3, padding="same")
    layer = copy.deepcopy(ref_layer).to(device="cuda", dtype=dtype)
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64)
    x_dev = x.to(device="cuda", dtype=dtype)
    if channels_last:
        x_dev = x_dev.to(memory_format=torch.channels_last)
    y = layer(x_dev)
    want = reference_conv(ref_layer)(x)
    scale = want.abs().max().item()
    torch.testing.assert_close(y.double().cpu(), want, rtol=tol, atol=tol * scale)
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    F.conv2d(x, ref_layer.effective_weight(), ref_layer.bias, padding="same").sum().backward()
    y.float().sum().backward()
    grad_scale = ref_layer.S.grad.abs().max().item()
    torch.testing.assert_close(layer.S.grad.double().cpu(), ref_layer.S.grad, rtol=tol, atol=tol * grad_scale)


@pytest.mark.cuda
def test_cuda_seed_gives_the_same_sketch_as_cpu():
    cpu = SKConv2d(4, 16, 3, num_terms=1, low_rank=4, seed=5)
    gpu = SKConv2d(4, 16, 3, num_terms=1, low_rank=4, seed=5, device="cuda")
    assert torch.equal(gpu.U.cpu(), cpu.U)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_and_compile(dtype):
    layer = make_layer(8, 16, L=1, k=4, dtype=torch.float32).cuda()
    x = torch.randn(2, 8, 16, 16, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert eager.dtype == dtype and compiled.dtype == dtype
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    compiled.float().sum().backward()
    assert layer.S.grad.dtype == torch.float32


def test_fixed_sketch_follows_parameter_dtype():
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts parameters and inputs, not buffers.
    layer = SKConv2d(4, 6, 3, num_terms=1, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    want = layer(x)
    layer.S = nn.Parameter(layer.S.detach().to(torch.bfloat16))
    layer.bias = nn.Parameter(layer.bias.detach().to(torch.bfloat16))
    got = layer(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and layer.U.dtype == torch.float64
    assert layer.effective_weight().dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


# ------------------------------------------------------------------ 1-D and 3-D


def options(dims):
    """Hypothesis strategy for (kernel, stride, dilation, padding) of a ``dims``-d conv."""
    ints = lambda lo, hi: st.tuples(*[st.integers(lo, hi)] * dims)  # noqa: E731
    padding = st.one_of(st.sampled_from(["same", "valid"]), st.integers(0, 2), ints(0, 2))
    return st.tuples(ints(1, 3), ints(1, 2), ints(1, 2), padding)


@pytest.mark.parametrize("dims,size", [(1, (9,)), (3, (5, 6, 4))])
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
    bias=st.booleans(),
    batched=st.booleans(),
)
def test_forward_equals_nn_conv_for_every_option_float64(dims, size, data, padding_mode, bias, batched):
    kernel, stride, dilation, padding = data.draw(options(dims))
    if padding == "same":
        stride = (1,) * dims
    span = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
    if any(s > n for s, n in zip(span, size)):  # reflect/valid need the kernel to fit the input
        return
    layer = make_layer(
        3, 4, L=1, k=2, dims=dims, kernel_size=kernel, stride=stride, padding=padding, dilation=dilation,
        bias=bias, padding_mode=padding_mode,
    )
    x = torch.randn(*((2,) if batched else ()), 3, *size, dtype=torch.float64)
    want = reference_conv(layer)(x)
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dims", [1, 3])
def test_float32_forward_and_backward_match_the_float64_reference(dims):
    layer64 = make_layer(4, 6, L=2, k=2, kernel_size=3, padding="same", padding_mode="reflect", dims=dims)
    layer32 = copy.deepcopy(layer64).float()
    x = torch.randn(2, 4, *((12,) if dims == 1 else (5, 6, 5)), dtype=torch.float64)
    want = reference_conv(layer64)(x)
    got = layer32(x.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got.sum().backward()
    F_conv = FAMILY[dims][2]
    F_conv(F.pad(x, layer64._reversed_padding_repeated_twice, mode="reflect"), layer64.effective_weight(),
           layer64.bias).sum().backward()
    scale = layer64.S.grad.abs().max().item()
    torch.testing.assert_close(layer32.S.grad.double(), layer64.S.grad, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("dims", [1, 3])
def test_backward_matches_dense_autograd_float64_1d_3d(dims):
    layer = make_layer(3, 4, L=2, k=2, stride=2, dims=dims)
    x = torch.randn(2, 3, *((9,) if dims == 1 else (5, 5, 5)), dtype=torch.float64, requires_grad=True)
    params = [layer.S, layer.bias]
    y = layer(x)
    grad_out = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], grad_out)
    ref = FAMILY[dims][2](x, layer.effective_weight(), layer.bias, stride=2, padding=1)
    want = torch.autograd.grad(ref, [x, *params], grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert layer.U.grad is None and not layer.U.requires_grad


@pytest.mark.parametrize("dims,size", [(1, (5,)), (2, (5, 4)), (3, (3, 4, 3))])
def test_gradcheck_float64(dims, size):
    layer = make_layer(2, 3, L=1, k=2, kernel_size=2, padding="same", padding_mode="circular", dims=dims)
    x = torch.randn(1, 2, *size, dtype=torch.float64, requires_grad=True)

    def fn(inp, S, bias):
        return torch.func.functional_call(layer, {"S": S, "bias": bias}, (inp,))

    S = layer.S.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (x, S, bias))
    assert torch.autograd.gradgradcheck(fn, (x, S, bias))


@pytest.mark.parametrize("dims", [1, 3])
def test_effective_weight_is_the_per_term_sum_and_views_share_storage(dims):
    kernel = (3,) if dims == 1 else (2, 3, 1)
    layer = make_layer(3, 5, L=2, k=2, kernel_size=kernel, dims=dims)
    torch.testing.assert_close(layer.effective_weight(), per_term_kernel(layer), rtol=1e-13, atol=1e-13)
    assert layer.S.shape == (8, 3, *kernel) and layer.U.shape == (8, 5)
    assert layer.Ss.shape == (4, 2, 3, *kernel) and layer.Us.shape == (4, 2, 5)
    assert layer.Ss.data_ptr() == layer.S.data_ptr()


@pytest.mark.parametrize("dims", [1, 3])
def test_from_conv_is_exact_at_full_rank_and_to_dense_round_trips(dims):
    dense_cls = FAMILY[dims][1]
    if dims == 1:
        conv = dense_cls(3, 4, 3, stride=2, padding=1, dilation=2, padding_mode="replicate", dtype=torch.float64)
        x = torch.randn(2, 3, 13, dtype=torch.float64)
    else:
        conv = dense_cls(3, 4, (3, 2, 1), stride=(1, 2, 1), padding=(1, 0, 0), padding_mode="circular",
                         dtype=torch.float64)
        x = torch.randn(2, 3, 5, 6, 4, dtype=torch.float64)
    layer = getattr(FAMILY[dims][0], FROM_DENSE[dims])(conv, 1, 2)  # 2Lk = 4 = C_out: exact
    assert layer.init == "svd" and layer.S.dtype == torch.float64
    torch.testing.assert_close(layer(x), conv(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer(x[0]), conv(x[0]), rtol=1e-10, atol=1e-10)  # unbatched
    dense = layer.to_dense()
    assert type(dense) is dense_cls and dense.weight.dtype == torch.float64
    for name in ("kernel_size", "stride", "padding", "dilation", "padding_mode"):
        assert getattr(dense, name) == getattr(conv, name) == getattr(layer, name), name
    torch.testing.assert_close(dense(x), layer(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dense.bias, conv.bias)
    no_bias = getattr(FAMILY[dims][0], FROM_DENSE[dims])(dense_cls(3, 4, 3, bias=False), 1, 2)
    assert no_bias.bias is None and no_bias.to_dense().bias is None


def test_calibrated_1d_fit_reaches_the_optimal_output_error():
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 10, 3, padding=1, dtype=torch.float64)
    mixing = torch.randn(4, 4, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.1, 0.01], dtype=torch.float64)
    x = torch.einsum("dc,ncl->ndl", mixing, torch.randn(6, 4, 20, dtype=torch.float64))
    # patches in weight.reshape(C_out, -1) order: (C_in, k)
    patches = F.pad(x, (1, 1)).unfold(2, 3, 1).permute(0, 2, 1, 3).reshape(-1, 12)
    gram = patches.t() @ patches
    L, k = 1, 2
    plain = SKConv1d.from_conv1d(conv, L, k)
    calibrated = SKConv1d.from_conv1d(conv, L, k, gram=gram)
    with torch.no_grad():
        exact = conv(x)
        torch.testing.assert_close(patches @ conv.weight.reshape(10, -1).t() + conv.bias,
                                   exact.transpose(1, 2).reshape(-1, 10))
        plain_error = (plain(x) - exact).norm()
        calibrated_error = (calibrated(x) - exact).norm()
    optimal_error = torch.linalg.svdvals(patches @ conv.weight.detach().reshape(10, -1).t())[2 * L * k :].norm()
    assert calibrated_error < 0.9 * plain_error
    torch.testing.assert_close(calibrated_error, optimal_error, rtol=2e-3, atol=0)


def test_channels_last_3d_input_gives_same_result_and_stays_channels_last_3d():
    layer = make_layer(4, 6, L=1, k=3, dtype=torch.float32, dims=3)
    x = torch.randn(2, 4, 5, 6, 7)
    x_cl = x.to(memory_format=torch.channels_last_3d)
    y, y_cl = layer(x), layer(x_cl)
    assert y_cl.is_contiguous(memory_format=torch.channels_last_3d) and y.is_contiguous()
    torch.testing.assert_close(y_cl, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", [1, 3])
def test_sketch_init_is_seeded_with_per_term_scale_and_default_init_has_dense_scale(dims):
    cls = FAMILY[dims][0]
    a = cls(4, 16, 3, num_terms=2, low_rank=2, seed=7)
    b = cls(4, 16, 3, num_terms=2, low_rank=2, seed=7)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    torch.testing.assert_close(a.U.abs(), torch.full_like(a.U, 1 / math.sqrt(2)))
    fan_in = 4 * 3**dims
    rms = a.effective_weight().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1 / math.sqrt(3 * fan_in), rel=1e-5)
    assert a.bias.abs().max() <= 1 / math.sqrt(fan_in)


@pytest.mark.parametrize("dims", [1, 3])
def test_parameter_counts_state_dict_and_repr(dims):
    cls = FAMILY[dims][0]
    layer = cls(16, 32, 3, padding=1, num_terms=1, low_rank=4, padding_mode="reflect")
    fan_in = 16 * 3**dims
    counts = layer.parameter_counts()
    assert counts == conv_sketch_size(fan_in, 32, 1, 4, True)
    assert counts.trainable == sum(p.numel() for p in layer.parameters())
    assert counts.stored == counts.trainable + sum(b.numel() for b in layer.buffers())
    assert set(layer.state_dict()) == {"S", "U", "bias"}
    ones = "(" + ", ".join(["1"] * dims) + (",)" if dims == 1 else ")")
    assert f"16, 32, kernel_size={(3,) * dims}, stride={ones}, padding={ones}" in repr(layer)
    assert "padding_mode='reflect', bias=True, num_terms=1, low_rank=4" in repr(layer)


def test_the_family_shares_skconv2d_signature():
    reference = inspect.signature(SKConv2d)
    for cls in (SKConv1d, SKConv3d):
        assert inspect.signature(cls) == reference
    names = list(reference.parameters)
    assert names == [
        "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
        "padding_mode", "device", "dtype", "num_terms", "low_rank", "layer", "init", "seed",
    ]


@pytest.mark.parametrize("dims", [1, 3])
def test_bad_options_and_inputs_raise_clear_errors(dims):
    cls, dense_cls, _ = FAMILY[dims]
    with pytest.raises(ValueError, match="groups=1"):
        cls(4, 4, 3, groups=2, num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="groups=1"):
        getattr(cls, FROM_DENSE[dims])(dense_cls(4, 4, 3, groups=2), 1, 1)
    with pytest.raises(ValueError, match="strided"):
        cls(4, 4, 3, padding="same", stride=2, num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match=f"kernel_size must be a positive int or a tuple of {dims}"):
        cls(4, 4, kernel_size=(3,) * (dims + 1), num_terms=1, low_rank=1)
    with pytest.raises(ValueError, match="padding"):
        cls(4, 4, 3, padding=(1,) * (dims + 1), num_terms=1, low_rank=1)
    with pytest.raises(TypeError, match=f"nn.Conv{dims}d"):
        getattr(cls, FROM_DENSE[dims])(nn.Conv2d(3, 3, 3) if dims != 2 else nn.Conv1d(3, 3, 3), 1, 1)
    with pytest.raises(TypeError, match=f"nn.Conv{dims}d"):
        cls(3, 4, 3, num_terms=1, low_rank=2, layer=nn.Linear(3, 4))
    layer = cls(4, 6, 3, padding=1, num_terms=1, low_rank=1)
    spatial = (8,) * dims
    for shape in ((2, 5, *spatial), spatial, (1, 1, 4, *spatial)):
        with pytest.raises(ValueError, match=r"C_in=4, got shape"):
            layer(torch.randn(shape))
    assert layer(torch.randn(0, 4, *spatial)).shape == (0, 6, *spatial)


def test_layer_argument_supplies_weight_and_bias():
    conv = nn.Conv3d(3, 4, 3, dtype=torch.float64)
    layer = SKConv3d(3, 4, 3, num_terms=1, low_rank=2, layer=conv, dtype=torch.float64, init="svd")
    torch.testing.assert_close(layer.effective_weight(), conv.weight, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.bias, conv.bias)
    with pytest.raises(ValueError, match=r"\(4, 3, 3, 3, 3\)"):
        SKConv3d(3, 4, 3, num_terms=1, low_rank=2, layer=nn.Conv3d(3, 4, 2))


@pytest.mark.parametrize("dims", [1, 3])
def test_compile_fullgraph_equals_eager(dims):
    layer = make_layer(
        3, 8, L=1, k=2, dtype=torch.float32, kernel_size=2, padding="same", padding_mode="reflect", dims=dims
    )
    x = torch.randn(2, 3, *((9,) if dims == 1 else (4, 5, 4)), requires_grad=True)
    y_eager = layer(x)
    y_comp = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    (gx_eager,) = torch.autograd.grad(y_eager.sum(), x)
    (gx_comp,) = torch.autograd.grad(y_comp.sum(), x)
    torch.testing.assert_close(gx_comp, gx_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", [1, 3])
def test_cpu_autocast_runs_low_precision_with_fp32_master_grads_1d_3d(dims):
    layer = make_layer(4, 8, L=1, k=4, dtype=torch.float32, dims=dims)
    x = torch.randn(2, 4, *((12,) if dims == 1 else (4, 5, 4)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    want = FAMILY[dims][2](x.double(), layer.effective_weight().double(), layer.bias.double(), padding=1)
    torch.testing.assert_close(y.double(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    y.float().sum().backward()
    assert layer.S.grad.dtype == torch.float32 and torch.isfinite(layer.S.grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dims", [1, 3])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_cuda_forward_matches_float64_reference(dims, dtype, tol, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref_layer = make_layer(8, 16, L=2, k=4, kernel_size=3, padding="same", dims=dims)
    layer = copy.deepcopy(ref_layer).to(device="cuda", dtype=dtype)
    x = torch.randn(2, 8, *((32,) if dims == 1 else (6, 8, 8)), dtype=torch.float64)
    x_dev = x.to(device="cuda", dtype=dtype)
    if dims == 3:
        x_dev = x_dev.to(memory_format=torch.channels_last_3d)
    y = layer(x_dev)
    want = reference_conv(ref_layer)(x)
    torch.testing.assert_close(y.double().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())
