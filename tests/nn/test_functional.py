"""The sketched-linear operator's routes: the custom op (autograd, compile, export), plain
GEMMs with cached factors (no grad), composable ops (torch.func, forward AD), and the
scale applied inside the GEMMs (no float16 overflow).

References are the dense computation ``x @ W_eff + b`` in plain PyTorch, float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap

from panther_lite.nn import SKLinear
from panther_lite.nn import functional
from panther_lite.nn.factor_cache import clear_factor_cache

F64 = dict(rtol=1e-12, atol=1e-12)
SCHEDULES = {"stacked": 0, "split": 10**9}  # rows-per-rank threshold forcing each schedule
IN, OUT = 24, 20  # L=2, k=2 stores less than the dense layer (no warning)


def make_layer(in_f=IN, out_f=OUT, L=2, k=2, bias=True, seed=0):
    layer = SKLinear(in_f, out_f, L, k, bias=bias, dtype=torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random factors, independent of the initialisation
        layer.S1.copy_(torch.randn(layer.S1.shape, generator=gen, dtype=torch.float64))
        layer.S2.copy_(torch.randn(layer.S2.shape, generator=gen, dtype=torch.float64))
    return layer


def dense(layer, x, S1, S2, bias):
    """The same map as plain matmuls on the effective weight."""
    weight = layer.scale * (S1 @ layer.U1 + layer.U2 @ S2)
    out = x @ weight
    return out if bias is None else out + bias


def sketched(layer, x, S1, S2, bias):
    params = {"S1": S1, "S2": S2} if bias is None else {"S1": S1, "S2": S2, "bias": bias}
    return functional_call(layer, params, (x,))


def primals(layer, rows=3, seed=2):
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x, layer.S1.detach(), layer.S2.detach(), None if layer.bias is None else layer.bias.detach())


# --- forward-mode AD and torch.func -------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 40])  # both schedules, had the op been used
def test_jvp_matches_dense_for_every_input(bias, rows):
    layer = make_layer(bias=bias)
    args = primals(layer, rows)
    gen = torch.Generator().manual_seed(3)
    tangents = tuple(None if a is None else torch.randn(a.shape, generator=gen, dtype=torch.float64) for a in args)
    n = 4 if bias else 3
    got_out, got_tangent = jvp(lambda *a: sketched(layer, *a, *args[n:]), args[:n], tangents[:n])
    want_out, want_tangent = jvp(lambda *a: dense(layer, *a, *args[n:]), args[:n], tangents[:n])
    assert got_tangent.abs().max() > 0.1
    torch.testing.assert_close(got_out, want_out, **F64)
    torch.testing.assert_close(got_tangent, want_tangent, **F64)


def test_bias_tangent_is_kept():
    layer = make_layer()
    x, S1, S2, b = primals(layer)
    tangent = torch.ones_like(b)
    _, got = jvp(lambda bias: sketched(layer, x, S1, S2, bias), (b,), (tangent,))
    torch.testing.assert_close(got, tangent.expand(x.shape[0], -1), **F64)


def test_forward_ad_dual_tensors_match_dense():
    layer = make_layer()
    x, *_ = primals(layer)
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(layer(fwAD.make_dual(x, tangent))).tangent
    torch.testing.assert_close(out, tangent @ layer.effective_weight().detach().t(), **F64)


@pytest.mark.parametrize("transform", [jacfwd, jacrev])
def test_jacobians_match_dense(transform):
    layer = make_layer()
    args = primals(layer)
    got = transform(lambda *a: sketched(layer, *a), argnums=(0, 1, 2, 3))(*args)
    want = transform(lambda *a: dense(layer, *a), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, **F64)


def test_grad_and_hessian_match_dense():
    layer = make_layer()
    args = primals(layer)

    def loss(fn):
        return lambda *a: fn(layer, *a).square().sum()

    for g, w in zip(grad(loss(sketched), argnums=(0, 1, 2, 3))(*args), grad(loss(dense), argnums=(0, 1, 2, 3))(*args)):
        torch.testing.assert_close(g, w, **F64)
    x, S1, S2, b = args
    got = hessian(lambda s: sketched(layer, x, s, S2, b).square().sum())(S1)
    want = hessian(lambda s: dense(layer, x, s, S2, b).square().sum())(S1)
    torch.testing.assert_close(got, want, **F64)


def test_per_sample_gradients_with_vmap_of_grad():
    layer = make_layer()
    x, S1, S2, b = primals(layer, rows=6)

    def per_sample(fn):
        return vmap(grad(lambda s, row: fn(layer, row, s, S2, b).square().sum()), in_dims=(None, 0))(S1, x)

    torch.testing.assert_close(per_sample(sketched), per_sample(dense), **F64)


def test_op_vmap_rule_still_folds_rows():
    layer = make_layer()
    xs = torch.randn(4, 3, IN, dtype=torch.float64)
    op = torch.ops.panther_lite.sketched_linear
    out, _ = vmap(lambda row: op(row, layer.S1, layer.U1, layer.U2, layer.S2, layer.bias, layer.scale))(xs)
    want = dense(layer, xs, layer.S1, layer.S2, layer.bias)
    torch.testing.assert_close(out, want, **F64)


# --- no-grad route: plain GEMMs, cached factors ---------------------------------------------------

@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(IN,), (1, IN), (40, IN), (2, 3, IN)])
def test_no_grad_route_matches_the_op(context, bias, shape):
    layer = make_layer(bias=bias)
    x = torch.randn(shape, dtype=torch.float64)
    want = layer(x).detach()
    with context():
        torch.testing.assert_close(layer(x), want, **F64)
        torch.testing.assert_close(layer(x), want, **F64)  # served from the cache


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 40), in_f=st.integers(1, 12), out_f=st.integers(1, 12),
    L=st.integers(1, 3), k=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 1000),
)
def test_every_route_computes_the_dense_map(rows, in_f, out_f, L, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, S1, U1, U2, S2 = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in (
        (rows, in_f), (in_f, L * k), (L * k, out_f), (in_f, L * k), (L * k, out_f)))
    b = torch.randn(out_f, generator=gen, dtype=torch.float64) if bias else None
    scale = 0.5 / L
    want = x @ (scale * (S1 @ U1 + U2 @ S2)) + (b if bias else 0)
    with torch.no_grad():
        torch.testing.assert_close(functional.sketched_linear(x, S1, U1, U2, S2, b, scale), want, **F64)
    grad_route = functional.sketched_linear(x, S1.requires_grad_(), U1, U2, S2, b, scale)
    torch.testing.assert_close(grad_route.detach(), want, **F64)
    _, tangent = jvp(lambda s: functional.sketched_linear(x, s, U1, U2, S2, b, scale), (S1.detach(),), (S1.detach(),))
    torch.testing.assert_close(tangent, x @ (scale * S1.detach() @ U1), **F64)


def test_no_grad_route_is_two_gemms_without_the_op(monkeypatch):
    layer = make_layer()
    calls = []
    monkeypatch.setattr(functional, "_sketched_linear_op", lambda *a: calls.append(1))
    with torch.inference_mode():
        layer(torch.randn(3, IN, dtype=torch.float64))
    assert calls == []


def test_cache_is_refreshed_after_an_optimizer_step_and_load_state_dict():
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    with torch.no_grad():
        before = layer(x)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        after_step = layer(x)
    assert not torch.allclose(after_step, before)
    torch.testing.assert_close(after_step, dense(layer, x, layer.S1, layer.S2, layer.bias).detach(), **F64)
    other = make_layer(seed=5)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), other(x), **F64)


def test_cache_is_refreshed_after_a_fused_optimizer_step():
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=True)  # moves no version counter
    with torch.no_grad():
        before = layer(x)
    layer(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        after = layer(x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, dense(layer, x, layer.S1, layer.S2, layer.bias).detach(), **F64)


def test_cache_is_refreshed_after_in_place_writes_and_moves():
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        layer.S2.mul_(2)
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)
        layer.U1.add_(1)  # a fixed sketch changed in place
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)
    with torch.inference_mode():
        layer.S1.zero_()
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)
    want = dense(layer, x, layer.S1, layer.S2, layer.bias).detach()
    layer.float()  # new tensors: a new cache entry
    with torch.no_grad():
        torch.testing.assert_close(layer(x.float()), want.float(), rtol=1e-5, atol=1e-5)


def test_data_writes_need_clear_factor_cache():
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
    layer.S1.data.mul_(3)  # .data bypasses the version counter, as documented
    clear_factor_cache()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)


def test_copies_do_not_share_cache_entries():
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.S1.mul_(2)
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)
        torch.testing.assert_close(twin(x), dense(twin, x, twin.S1, twin.S2, twin.bias), **F64)


def test_layer_built_in_inference_mode_runs_there():
    with torch.inference_mode():
        layer = make_layer()
        x = torch.randn(5, IN, dtype=torch.float64)
        torch.testing.assert_close(layer(x), dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)


def test_no_grad_route_gives_the_clear_dtype_error():
    layer = make_layer()
    with torch.no_grad(), pytest.raises(TypeError, match="S1 has dtype torch.float64 but the input has torch.float32"):
        layer(torch.randn(2, IN))


def test_frozen_layer_with_grad_enabled_takes_the_no_grad_route():
    layer = make_layer().requires_grad_(False)
    x = torch.randn(5, IN, dtype=torch.float64)
    out = layer(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, dense(layer, x, layer.S1, layer.S2, layer.bias), **F64)


def test_compile_under_no_grad_keeps_the_op_without_graph_breaks():
    torch._dynamo.reset()
    layer = make_layer()
    x = torch.randn(5, IN, dtype=torch.float64)
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), layer(x), **F64)
        exported = torch.export.export(layer, (x,))
    assert "panther_lite.sketched_linear" in str(exported.graph)


# --- the scale inside the GEMMs: no float16 overflow -----------------------------------------------

def big_factor_operands(bias: bool, rows: int):
    """float16 factors whose unscaled products overflow (> 65504) while the output is 24000."""
    L, rank, width = 4, 4, 16
    x = torch.full((rows, width), 1.0, dtype=torch.float16)
    S1 = torch.full((width, rank), 1.0, dtype=torch.float16)  # x·S1 = 16
    U1 = torch.full((rank, width), 2 * L * 250, dtype=torch.float16)  # (x·S1)·U1 = 128000
    U2 = torch.full((width, rank), 1 / 16, dtype=torch.float16)  # x·U2 = 1
    S2 = torch.full((rank, width), 2 * L * 2000, dtype=torch.float16)  # (x·U2)·S2 = 64000
    b = torch.ones(width, dtype=torch.float16) if bias else None
    return x, S1, U1, U2, S2, b, 0.5 / L


@pytest.mark.parametrize("route", ["op-stacked", "op-split", "no-grad", "no-grad-uncached", "transform"])
@pytest.mark.parametrize("bias", [True, False])
def test_float16_products_are_scaled_inside_the_gemm(monkeypatch, route, bias):
    x, S1, U1, U2, S2, b, scale = big_factor_operands(bias, rows=4 if route != "op-stacked" else 64)
    want = (x.double() @ S1.double() @ U1.double() + x.double() @ U2.double() @ S2.double()) * scale
    want = want + (b.double() if bias else 0)
    assert want.abs().max() < 65504 < (want / scale).abs().max()
    if route.startswith("op"):
        monkeypatch.setattr(functional, "_STACKED_ROWS_PER_RANK", SCHEDULES[route[3:]])
        S1.requires_grad_(True)
        out = functional.sketched_linear(x, S1, U1, U2, S2, b, scale)
    elif route == "transform":
        out = vmap(lambda row: functional.sketched_linear(row, S1, U1, U2, S2, b, scale))(x)
    else:
        with torch.no_grad():
            if route == "no-grad-uncached":  # per-call copies (here: U in float32) are not cached
                U1, U2 = U1.float(), U2.float()
            out = functional.sketched_linear(x, S1, U1, U2, S2, b, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=0)


@pytest.mark.parametrize("num_terms", [1, 4])
def test_float16_svd_conversion_stays_finite_where_dense_is(num_terms):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48, dtype=torch.float64)
    with torch.no_grad():  # rank 16 = 2Lk: the fit is exact
        low_rank = torch.randn(48, 16, generator=gen, dtype=torch.float64) @ torch.randn(16, 64, generator=gen, dtype=torch.float64)
        linear.weight.copy_(low_rank * 15)
    x = torch.randn(32, 64, generator=gen, dtype=torch.float64) * 8
    dense_out = linear(x)
    assert 3000 < dense_out.abs().max() < 20000
    layer = SKLinear.from_linear(linear.half(), num_terms, 8 // num_terms)
    for context in (torch.enable_grad, torch.no_grad):
        with context():
            out = layer(x.half())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), dense_out, rtol=0, atol=2e-2 * dense_out.abs().max().item())


def test_jit_trace_records_the_op_so_later_weight_updates_are_seen():
    layer = SKLinear(16, 8, 2, 2, seed=0).requires_grad_(False)
    x = torch.randn(3, 16)
    layer(x)  # warm the no-grad factor cache: the trace must not capture it as constants
    traced = torch.jit.trace(layer, (x,), check_trace=False)
    with torch.no_grad():
        layer.S1.mul_(2)
    torch.testing.assert_close(traced(x), layer(x))
