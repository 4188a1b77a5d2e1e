"""SKExperts' gradients (gradcheck, and against the dense experts' autograd through the
effective weights), autocast, torch.compile and the no-grad factor cache."""
import pytest
import torch
from torch.func import functional_call

from panther_lite.nn import SKExperts
from panther_lite.nn.skexperts import IMPLEMENTATIONS

pytestmark = pytest.mark.filterwarnings("ignore:.*more than the dense layer:UserWarning")


@pytest.fixture
def fresh_compile():
    """Compile from scratch: the on-disk graph caches key on the traced graph, not on a custom
    op's implementation, so an artifact compiled against an earlier version of the op could
    be served instead of the code under test."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def trainable(sketched):
    return {name: p for name, p in sketched.named_parameters() if name.split(".")[0] in sketched.sizes}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model", ["mixtral", "gpt_oss"])
def test_gradcheck_float64(model, implementation, moe):
    sketched = SKExperts.from_experts(moe.dense_experts(model, dtype=torch.float64), 1, 2, implementation=implementation)
    hidden, index, weights = moe.routing(tokens=5, dtype=torch.float64, skip_expert=1)
    names = list(trainable(sketched))

    def f(hidden, weights, *params):
        return functional_call(sketched, dict(zip(names, params)), (hidden, index, weights))

    inputs = [hidden, weights] + [p.detach().clone() for p in trainable(sketched).values()]
    for t in inputs:
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_equal_the_dense_experts_autograd_through_the_effective_weights(implementation, moe):
    dense = moe.dense_experts("gpt_oss", dtype=torch.float64)
    sketched = SKExperts.from_experts(dense, 1, 2, implementation=implementation)
    hidden, index, weights = moe.routing(tokens=11, dtype=torch.float64)
    hidden.requires_grad_(True)
    weights.requires_grad_(True)
    probe = torch.randn(11, moe.HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    wrt = [hidden, weights] + list(trainable(sketched).values())
    got = torch.autograd.grad((sketched(hidden, index, weights) * probe).sum(), wrt)
    dense_params = dict(sketched.effective_weights())
    dense_params.update({f"{name}_bias": projection.bias for name, projection in zip(("gate_up_proj", "down_proj"),
                                                                                         sketched.projections())})
    expected = torch.autograd.grad((functional_call(dense, dense_params, (hidden, index, weights)) * probe).sum(), wrt)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert all(b.grad is None for b in sketched.buffers())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_autocast_bfloat16_runs_the_products_in_bfloat16_with_float32_gradients(implementation, moe):
    dense = moe.dense_experts("mixtral", implementation="eager")
    sketched = SKExperts.from_experts(dense, *moe.full_rank_terms(), implementation=implementation)
    hidden, index, weights = moe.routing(tokens=12)
    full = sketched(hidden, index, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sketched.gate_up_proj.operands(hidden)[1].dtype == torch.bfloat16
        out = sketched(hidden, index, weights)
        dense_out = dense(hidden, index, weights)
    assert out.dtype == torch.float32
    relative = float((out - full).norm() / full.norm())
    assert 1e-5 < relative < 3e-2  # rounded like bfloat16, not float32
    torch.testing.assert_close(out, dense_out, rtol=0, atol=3e-2 * float(full.abs().max()))
    out.square().sum().backward()
    for p in trainable(sketched).values():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_compile_fullgraph_equals_eager_forward_and_backward(implementation, moe, fresh_compile):
    sketched = SKExperts.from_experts(moe.dense_experts("gpt_oss"), 1, 2, implementation=implementation)
    hidden, index, weights = moe.routing(tokens=10, skip_expert=0)
    compiled = torch.compile(sketched, fullgraph=True)
    results = []
    for run in (compiled, sketched):
        x = hidden.clone().requires_grad_(True)
        out = run(x, index, weights)
        grads = torch.autograd.grad(out.square().sum(), [x] + list(trainable(sketched).values()))
        results.append((out, grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for g_compiled, g_eager in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g_compiled, g_eager, rtol=1e-5, atol=1e-6)


def test_eager_schedule_compiles_with_graph_breaks(moe, fresh_compile):
    sketched = SKExperts.from_experts(moe.dense_experts("mixtral"), 1, 2, implementation="eager")
    hidden, index, weights = moe.routing()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(sketched)(hidden, index, weights), sketched(hidden, index, weights))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_grad_calls_see_every_optimizer_step(implementation, moe):
    sketched = SKExperts.from_experts(moe.dense_experts("mixtral"), 1, 2, implementation=implementation)
    hidden, index, weights = moe.routing()
    optimizer = torch.optim.SGD(sketched.parameters(), lr=0.5)
    for _ in range(2):
        with torch.no_grad():
            cached = sketched(hidden, index, weights)
        fresh = sketched(hidden, index, weights)  # with autograd: never cached
        torch.testing.assert_close(cached, fresh.detach(), rtol=1e-6, atol=1e-7)
        fresh.square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.allclose(cached, sketched(hidden, index, weights).detach())
