"""SKLinear against a plain-PyTorch per-term reference, plus its contract."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import SKConv2d, SKLinear
from panther_lite.nn.functional import sketched_linear

def reference_forward(layer: SKLinear, x: torch.Tensor) -> torch.Tensor:
    """The anchor's formula term by term: 1/(2L) Σ_i (x S1_i U1_i + x U2_i S2_i) + b."""
    L = layer.num_terms
    total = sum(x @ layer.S1s[i] @ layer.U1s[i] + x @ layer.U2s[i] @ layer.S2s[i] for i in range(L))
    out = total / (2 * L)
    return out if layer.bias is None else out + layer.bias


def make_layer(in_f, out_f, L, k, bias=True, dtype=torch.float64, seed=0, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        layer = SKLinear(in_f, out_f, L, k, bias=bias, dtype=dtype, seed=seed, **kwargs)
    with torch.no_grad():  # random S so the test does not depend on how S was initialised
        gen = torch.Generator().manual_seed(seed + 1)
        layer.S1.copy_(torch.randn(layer.S1.shape, generator=gen, dtype=dtype))
        layer.S2.copy_(torch.randn(layer.S2.shape, generator=gen, dtype=dtype))
    return layer


SHAPES = [(16, 16), (37, 23), (8, 64)]
CONFIGS = [(1, 1), (1, 16), (3, 5), (4, 8)]
INPUT_LEADS = [(), (5,), (2, 3)]


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("L,k", CONFIGS)
@pytest.mark.parametrize("lead", INPUT_LEADS)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_per_term_reference_float64(in_f, out_f, L, k, lead, bias):
    layer = make_layer(in_f, out_f, L, k, bias=bias)
    x = torch.randn(*lead, in_f, dtype=torch.float64)
    y = layer(x)
    assert y.shape == (*lead, out_f)
    torch.testing.assert_close(y, reference_forward(layer, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("L,k", CONFIGS)
@pytest.mark.parametrize("bias", [True, False])
def test_backward_matches_per_term_reference_float64(in_f, out_f, L, k, bias):
    layer = make_layer(in_f, out_f, L, k, bias=bias)
    x = torch.randn(2, 3, in_f, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 3, out_f, dtype=torch.float64)
    params = [p for p in (layer.S1, layer.S2, layer.bias) if p is not None]

    grads = torch.autograd.grad(layer(x), [x, *params], grad_out)
    ref_grads = torch.autograd.grad(reference_forward(layer, x), [x, *params], grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_float32_matches_float64_reference():
    layer = make_layer(96, 80, 2, 8, dtype=torch.float64)
    x = torch.randn(33, 96, dtype=torch.float64)
    want = reference_forward(layer, x)
    got = copy.deepcopy(layer).float()(x.float())
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)


def test_gradcheck_float64():
    layer = make_layer(7, 5, 2, 3)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)

    def f(x, S1, S2, bias):
        return sketched_linear(x, S1, layer.U1, layer.U2, S2, bias, layer.scale)

    assert torch.autograd.gradcheck(f, (x, layer.S1, layer.S2, layer.bias))


def test_custom_op_passes_opcheck():
    layer = make_layer(12, 9, 2, 3)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    args = (x, layer.S1, layer.U1, layer.U2, layer.S2, layer.bias, layer.scale)
    torch.library.opcheck(torch.ops.panther_lite.sketched_linear.default, args)


def test_sketch_buffers_are_not_trained_and_are_saved():
    layer = make_layer(10, 6, 2, 2)
    assert {n for n, _ in layer.named_parameters()} == {"S1", "S2", "bias"}
    assert {"U1", "U2"} <= set(layer.state_dict())
    layer(torch.randn(3, 10, dtype=torch.float64)).sum().backward()
    assert layer.U1.grad is None and layer.U2.grad is None


def test_backward_saves_only_input_and_hidden_activation():
    batch, in_f, out_f, L, k = 64, 48, 40, 2, 3
    layer = make_layer(in_f, out_f, L, k)
    x = torch.randn(batch, in_f, dtype=torch.float64, requires_grad=True)
    param_ptrs = {t.data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    activations = {t.data_ptr(): t.numel() for t in saved if t.data_ptr() not in param_ptrs}
    assert sum(activations.values()) <= batch * in_f + batch * L * k


@settings(max_examples=25, deadline=None)
@given(
    in_f=st.integers(1, 20),
    out_f=st.integers(1, 20),
    L=st.integers(1, 4),
    k=st.integers(1, 6),
    lead=st.lists(st.integers(1, 3), max_size=3),
    a=st.floats(-3, 3),
    b=st.floats(-3, 3),
)
def test_linearity_and_shape_property(in_f, out_f, L, k, lead, a, b):
    layer = make_layer(in_f, out_f, L, k, bias=False)
    x = torch.randn(*lead, in_f, dtype=torch.float64)
    z = torch.randn(*lead, in_f, dtype=torch.float64)
    y = layer(a * x + b * z)
    assert y.shape == (*lead, out_f)
    torch.testing.assert_close(y, a * layer(x) + b * layer(z), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, (a * x + b * z) @ layer.effective_weight().t(), rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(in_f=st.integers(1, 12), out_f=st.integers(1, 12), L=st.integers(1, 3), k=st.integers(1, 4))
def test_gradient_property_matches_dense_autograd(in_f, out_f, L, k):
    layer = make_layer(in_f, out_f, L, k)
    x = torch.randn(3, in_f, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).square().sum(), x)
    x2 = x.detach().clone().requires_grad_()
    dense = x2 @ layer.effective_weight().detach().t() + layer.bias.detach()
    (gx_ref,) = torch.autograd.grad(dense.square().sum(), x2)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-10)


def truncated(weight: torch.Tensor, rank: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(weight, full_matrices=False)
    return (U[:, :rank] * S[:rank]) @ Vh[:rank]


@pytest.mark.parametrize("in_f,out_f,L,k", [(40, 48, 2, 5), (33, 17, 1, 4), (20, 30, 3, 4), (8, 6, 2, 3)])
def test_svd_init_is_best_rank_2lk_fit(in_f, out_f, L, k):
    W = torch.randn(out_f, in_f, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        layer = SKLinear(in_f, out_f, L, k, W_init=W, dtype=torch.float64, init="svd")
    torch.testing.assert_close(layer.effective_weight(), truncated(W, 2 * L * k), rtol=1e-10, atol=1e-10)


def test_calibrated_svd_reaches_the_optimal_output_error():
    torch.manual_seed(0)
    in_f, out_f, L, k = 24, 20, 1, 3
    W = torch.randn(out_f, in_f, dtype=torch.float64)
    X = torch.randn(200, in_f, dtype=torch.float64) * torch.logspace(0, -2, in_f, dtype=torch.float64)
    layer = SKLinear(in_f, out_f, L, k, W_init=W, dtype=torch.float64, init="svd")
    plain_error = (X @ (W - layer.effective_weight()).t()).norm()
    layer.initialize_from_weight(W, init="svd", gram=X.t() @ X)
    calibrated_error = (X @ (W - layer.effective_weight()).t()).norm()
    optimal_error = torch.linalg.svdvals(X @ W.t())[2 * L * k :].norm()
    assert calibrated_error < 0.9 * plain_error
    torch.testing.assert_close(calibrated_error, optimal_error, rtol=2e-3, atol=0)


def test_sketch_init_error_matches_theory_and_is_unbiased():
    in_f, out_f, L, k = 128, 96, 2, 8
    W = torch.randn(out_f, in_f, dtype=torch.float64)
    estimates = [
        SKLinear(in_f, out_f, L, k, W_init=W, dtype=torch.float64, seed=s).effective_weight().detach()
        for s in range(64)
    ]
    theory = math.sqrt((in_f + out_f) / (4 * L * k))
    single = torch.stack([(e - W).norm() / W.norm() for e in estimates])
    assert abs(single.mean().item() / theory - 1) < 0.15
    averaged = torch.stack(estimates).mean(0)
    assert ((averaged - W).norm() / W.norm()).item() < 1.5 * theory / math.sqrt(len(estimates))


def test_seed_reproduces_sketches():
    W = torch.randn(48, 40)
    a = SKLinear(40, 48, 2, 2, W_init=W, seed=7)
    b = SKLinear(40, 48, 2, 2, W_init=W, seed=7)
    c = SKLinear(40, 48, 2, 2, W_init=W, seed=8)
    assert torch.equal(a.U1, b.U1) and torch.equal(a.U2, b.U2) and torch.equal(a.S1, b.S1)
    assert not torch.equal(a.U1, c.U1)
    torch.testing.assert_close(a.U1.abs(), torch.full_like(a.U1, 1 / math.sqrt(2)))
    torch.testing.assert_close(a.U2.abs(), torch.full_like(a.U2, 1 / math.sqrt(2)))


@pytest.mark.parametrize("init", ["sketch", "svd"])
@pytest.mark.parametrize("in_f,out_f,L,k", [(256, 8, 2, 2), (64, 512, 1, 4), (300, 300, 2, 16)])
def test_default_init_has_linear_scale_with_fan_in_in_features(init, in_f, out_f, L, k):
    layer = SKLinear(in_f, out_f, L, k, init=init, seed=0)
    rms = layer.effective_weight().pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1 / math.sqrt(3 * in_f), rel=1e-5)  # nn.Linear's U(±1/√in_features)
    assert layer.bias.abs().max() <= 1 / math.sqrt(in_f)


def test_default_init_keeps_activations_at_dense_scale_through_depth():
    torch.manual_seed(0)
    width, depth = 512, 6

    def stack(make):
        return nn.Sequential(*[m for _ in range(depth) for m in (make(), nn.ReLU())])

    x = torch.randn(64, width)
    dense_std = stack(lambda: nn.Linear(width, width))(x).std().item()
    sketched_std = stack(lambda: SKLinear(width, width, 1, 16))(x).std().item()
    assert 0.5 < sketched_std / dense_std < 2


def test_seed_reproduces_the_whole_default_layer():
    a = SKLinear(40, 48, 2, 2, seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    b = SKLinear(40, 48, 2, 2, seed=3)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_integer_seed_is_a_type_error(device):
    for bad in (1.5, "3"):
        with pytest.raises(TypeError, match="seed must be an int"):
            SKLinear(40, 48, 2, 2, seed=bad, device=device)
        with pytest.raises(TypeError, match="seed must be an int"):
            SKConv2d(4, 8, 3, num_terms=1, low_rank=2, seed=bad, device=device)


def test_seeded_sketches_do_not_depend_on_bias_or_call_path():
    W = torch.randn(48, 40)
    with_bias = SKLinear(40, 48, 2, 2, W_init=W, seed=5)
    without_bias = SKLinear(40, 48, 2, 2, W_init=W, seed=5, bias=False)
    refit = SKLinear(40, 48, 2, 2, W_init=torch.randn(48, 40), seed=5)
    refit.initialize_from_weight(W, init="sketch")
    for other in (without_bias, refit):
        assert torch.equal(with_bias.U1, other.U1) and torch.equal(with_bias.U2, other.U2)
        torch.testing.assert_close(with_bias.S1, other.S1)


def test_effective_weight_and_to_dense_compute_the_same_function():
    layer = make_layer(30, 20, 2, 4, dtype=torch.float32)
    x = torch.randn(6, 30)
    dense = layer.to_dense()
    assert isinstance(dense, nn.Linear) and dense.weight.dtype == torch.float32
    torch.testing.assert_close(dense(x), layer(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), x @ layer.effective_weight().t() + layer.bias, rtol=1e-5, atol=1e-5)


def test_from_linear_keeps_dtype_bias_and_fits_best_rank():
    linear = nn.Linear(20, 16, dtype=torch.float64)
    layer = SKLinear.from_linear(linear, 1, 4)
    assert layer.S1.dtype == torch.float64 and layer.init == "svd"
    torch.testing.assert_close(layer.bias, linear.bias)
    torch.testing.assert_close(layer.effective_weight(), truncated(linear.weight.detach(), 8), rtol=1e-10, atol=1e-10)
    no_bias = SKLinear.from_linear(nn.Linear(20, 16, bias=False), 1, 4)
    assert no_bias.bias is None
    with pytest.raises(TypeError, match="nn.Linear"):
        SKLinear.from_linear(nn.Conv2d(3, 3, 3), 1, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
@pytest.mark.parametrize("arg", ["num_terms", "low_rank"])
def test_invalid_sizes_raise(arg, bad):
    kwargs = dict(in_features=8, out_features=8, num_terms=1, low_rank=1)
    kwargs[arg] = bad
    with pytest.raises(ValueError, match=arg):
        SKLinear(**kwargs)


def test_invalid_init_and_w_init_shape_raise():
    with pytest.raises(ValueError, match="init"):
        SKLinear(8, 8, 1, 1, init="random")
    with pytest.raises(ValueError, match=r"\(6, 8\).*\(8, 6\)"):
        SKLinear(8, 6, 1, 1, W_init=torch.randn(8, 6))
    with pytest.raises(TypeError, match="W_init must be a Tensor"):
        SKLinear(2, 2, 1, 1, W_init=[[1.0, 0.0], [0.0, 1.0]])


def test_wrong_input_size_raises_naming_expected_size():
    layer = SKLinear(8, 6, 1, 1)
    with pytest.raises(ValueError, match="in_features=8"):
        layer(torch.randn(3, 7))


def test_failed_reinitialisation_changes_nothing():
    layer = make_layer(8, 6, 1, 2)
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(ValueError):
        layer.initialize_from_weight(torch.randn(5, 5, dtype=torch.float64))
    with pytest.raises(ValueError):
        layer.initialize_from_weight(torch.randn(6, 8, dtype=torch.float64), init="sketch", gram=torch.eye(8))
    with pytest.raises(ValueError, match=r"gram must have shape .* \(8, 8\), got \(6, 6\)"):
        layer.initialize_from_weight(torch.randn(6, 8, dtype=torch.float64), gram=torch.eye(6))
    with pytest.raises(ValueError, match="gram must have shape"):
        SKLinear.from_linear(nn.Linear(8, 6), 1, 2, gram=torch.eye(6))
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_warns_when_stored_size_exceeds_dense():
    with pytest.warns(UserWarning, match="more than the dense"):
        SKLinear(16, 16, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SKLinear(256, 256, 1, 16)


def test_parameter_counts_say_what_they_count():
    layer = SKLinear(64, 32, 2, 4)
    counts = layer.parameter_counts()
    assert counts.trainable == sum(p.numel() for p in layer.parameters())
    assert counts.stored == counts.trainable + sum(b.numel() for b in layer.buffers())
    assert counts.trainable == 2 * 4 * (64 + 32) + 32


def test_extra_repr_names_the_configuration():
    text = repr(SKLinear(64, 32, 2, 4, bias=False))
    assert "in_features=64, out_features=32, num_terms=2, low_rank=4, bias=False" in text


def test_state_dict_round_trip_and_deepcopy():
    layer = make_layer(12, 10, 2, 3)
    fresh = make_layer(12, 10, 2, 3, seed=99)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    clone = copy.deepcopy(layer)
    torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
    with torch.no_grad():
        clone.S1.add_(1)
    assert not torch.equal(clone.S1, layer.S1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_to_dtype_runs_in_that_dtype(dtype, tol):
    layer = make_layer(32, 24, 2, 4)
    x = torch.randn(5, 32, dtype=torch.float64)
    want = reference_forward(layer, x)
    low = copy.deepcopy(layer).to(dtype)
    assert low.U1.dtype == dtype and low.S1.dtype == dtype
    got = low(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_runs_low_precision_with_fp32_master_grads(dtype):
    layer = make_layer(32, 24, 2, 4, dtype=torch.float32)
    x = torch.randn(2, 5, 32)
    want = reference_forward(layer, x)
    with torch.autocast("cpu", dtype=dtype):
        got = layer(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    got.float().sum().backward()
    assert layer.S1.grad.dtype == torch.float32 and layer.S2.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32


def test_compile_fullgraph_equals_eager_forward_and_backward():
    torch._dynamo.reset()
    layer = make_layer(24, 16, 2, 4, dtype=torch.float32)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(3, 5, 24)
    y_eager = layer(x)
    (g_eager,) = torch.autograd.grad(y_eager.sum(), layer.S1)
    y_comp = compiled(x)
    (g_comp,) = torch.autograd.grad(y_comp.sum(), layer.S1)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    layer = SKLinear(8, 6, 1, 2)
    assert layer(torch.randn(0, 8)).shape == (0, 6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("in_f,out_f,L,k", [(64, 48, 1, 16), (37, 23, 3, 5)])
def test_cuda_forward_backward_matches_float64_reference(dtype, tol, in_f, out_f, L, k):
    layer = make_layer(in_f, out_f, L, k)
    x = torch.randn(7, in_f, dtype=torch.float64)
    want = reference_forward(layer, x)
    gpu = copy.deepcopy(layer).to("cuda", dtype)
    got = gpu(x.to("cuda", dtype))
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol * scale)
    got.float().sum().backward()
    assert gpu.S1.grad.dtype == dtype and torch.isfinite(gpu.S1.grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_and_compile(dtype):
    layer = make_layer(64, 64, 2, 8, dtype=torch.float32).cuda()
    x = torch.randn(16, 64, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert eager.dtype == dtype and compiled.dtype == dtype
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    compiled.float().sum().backward()
    assert layer.S1.grad.dtype == torch.float32


def test_torch_export_keeps_the_custom_op():
    layer = make_layer(16, 12, 2, 3, dtype=torch.float32)
    x = torch.randn(4, 16)
    exported = torch.export.export(layer, (x,))
    assert "panther_lite.sketched_linear" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), layer(x), rtol=0, atol=0)


def test_fixed_sketches_follow_parameter_dtype():
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts parameters and inputs, not buffers.
    layer = make_layer(32, 24, 2, 4)
    want = reference_forward(layer, x := torch.randn(5, 32, dtype=torch.float64))
    for name in ("S1", "S2", "bias"):
        setattr(layer, name, nn.Parameter(getattr(layer, name).detach().to(torch.bfloat16)))
    got = layer(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and layer.U1.dtype == torch.float64
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_autocast_leaves_float64_alone():
    layer = make_layer(16, 12, 1, 3)
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, reference_forward(layer, x), rtol=1e-12, atol=1e-12)


def test_mismatched_dtype_and_trainable_sketch_raise_clearly():
    layer = make_layer(16, 12, 1, 3, dtype=torch.float32)
    with pytest.raises(TypeError, match="S1 has dtype torch.float32 but the input has torch.float64"):
        layer(torch.randn(2, 16, dtype=torch.float64))
    layer.U1.requires_grad_()
    with pytest.raises(ValueError, match="fixed sketches"):
        layer(torch.randn(2, 16))


def test_from_linear_with_gram_runs_one_decomposition(monkeypatch):
    import panther_lite.nn.linear_factors as sklinear_module

    calls = []
    real = sklinear_module.sketch_factors_from_weight
    counting = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(sklinear_module, "sketch_factors_from_weight", counting)
    linear = nn.Linear(20, 16, dtype=torch.float64)
    SKLinear.from_linear(linear, 1, 4)
    SKLinear.from_linear(linear, 1, 4, gram=torch.eye(20, dtype=torch.float64))
    assert len(calls) == 2


SCHEDULES = {"stacked": 0, "split": 10**9}  # rows-per-rank threshold forcing each schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("frozen", [(), ("x",), ("S1",), ("S2",), ("x", "S1"), ("S1", "S2"), ("x", "S2")])
@pytest.mark.parametrize("bias", [True, False])
def test_backward_for_every_schedule_and_frozen_set(monkeypatch, schedule, frozen, bias):
    import panther_lite.nn.functional as functional

    monkeypatch.setattr(functional, "_STACKED_ROWS_PER_RANK", SCHEDULES[schedule])
    layer = make_layer(11, 9, 2, 3, bias=bias)
    x = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad="x" not in frozen)
    for name in frozen:
        if name != "x":
            getattr(layer, name).requires_grad_(False)
    wanted = [t for t in (x, layer.S1, layer.S2, layer.bias) if t is not None and t.requires_grad]
    grad_out = torch.randn(2, 5, 9, dtype=torch.float64)
    got = torch.autograd.grad(layer(x), wanted, grad_out)
    want = torch.autograd.grad(reference_forward(layer, x), wanted, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_both_outputs_of_the_op(monkeypatch, schedule, bias):
    import panther_lite.nn.functional as functional

    monkeypatch.setattr(functional, "_STACKED_ROWS_PER_RANK", SCHEDULES[schedule])
    layer = make_layer(6, 5, 2, 2, bias=bias)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def f(x, S1, S2, *bias):
        return torch.ops.panther_lite.sketched_linear(x, S1, layer.U1, layer.U2, S2, bias[0] if bias else None, 0.25)

    inputs = (x, layer.S1, layer.S2) + ((layer.bias,) if bias else ())
    assert torch.autograd.gradcheck(f, inputs)


def test_backward_saves_nothing_for_frozen_factors():
    layer = make_layer(16, 12, 1, 2)
    layer.S1.requires_grad_(False)
    layer.S2.requires_grad_(False)
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    param_ptrs = {t.data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    assert [t for t in saved if t.data_ptr() not in param_ptrs] == []


def test_meta_device_construction_and_forward():
    layer = SKLinear(4096, 2048, 1, 16, device="meta")
    assert layer.S1.is_meta and layer.U1.is_meta
    y = layer(torch.empty(3, 7, 4096, device="meta"))
    assert y.shape == (3, 7, 2048) and y.is_meta


def test_vmap_over_inputs_and_over_stacked_parameters():
    from torch.func import functional_call, vmap

    layer = make_layer(40, 36, 2, 3)
    xs = torch.randn(5, 4, 40, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow per-sample fallback
        torch.testing.assert_close(vmap(layer)(xs), torch.stack([layer(x) for x in xs]), rtol=1e-12, atol=1e-12)
    buffers = dict(layer.named_buffers())
    ensemble = {name: torch.stack([p.detach() * (i + 1) for i in range(3)]) for name, p in layer.named_parameters()}

    def run(params, x):
        return functional_call(layer, (params, buffers), (x,))

    for in_dims, inputs in (((0, None), xs[0]), ((0, 0), xs[:3])):
        got = vmap(run, in_dims=in_dims)(ensemble, inputs)
        want = torch.stack(
            [run({n: p[i] for n, p in ensemble.items()}, inputs if in_dims[1] is None else inputs[i]) for i in range(3)]
        )
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _Doubled(nn.Module):
    def forward(self, S: torch.Tensor) -> torch.Tensor:
        return 2 * S


@pytest.mark.parametrize("grad", [True, False])
def test_parametrized_factors_are_used_by_forward(grad):
    from torch.nn.utils import parametrize

    layer = SKLinear(12, 6, 2, 3, seed=0, dtype=torch.float64)
    x = torch.randn(5, 12, dtype=torch.float64)
    with torch.no_grad():
        expected = x @ layer.effective_weight().t() + layer.bias
        expected = expected + x @ (layer.scale * layer.S1 @ layer.U1)  # S1 -> 2·S1 adds one more S1 term
    parametrize.register_parametrization(layer, "S1", _Doubled())
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(layer(x), expected)
