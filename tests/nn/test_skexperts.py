"""SKExperts against transformers' dense experts modules (every implementation) and a
per-token reference: exactness at full rank, the fits, the seam into a whole model, the
dense twin and bad arguments."""
import copy

import pytest
import torch
import torch.nn as nn

from panther_lite.nn import SKExperts, SKStackedLinear
from panther_lite.nn.skexperts import IMPLEMENTATIONS

MODELS = ["gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
pytestmark = pytest.mark.filterwarnings("ignore:.*more than the dense layer:UserWarning")


def per_token_reference(experts: SKExperts, hidden, index, weights):
    """``Σ_k w·down(gate(up(x)))`` token by token in float64 from the effective weights."""
    dense = {name: w.double() for name, w in experts.effective_weights().items()}
    up_name, up, down = experts._projection_names[0], *dense.values()
    first, second = experts.projections()
    if first.transposed:
        up, down = up.transpose(-1, -2), down.transpose(-1, -2)
    rows = []
    for t in range(hidden.shape[0]):
        total = torch.zeros(hidden.shape[1], dtype=torch.float64)
        for k in range(index.shape[1]):
            e = int(index[t, k])
            h = up[e] @ hidden[t].double() + (0 if first.bias is None else first.bias[e].double())
            h = experts.activate(h.unsqueeze(0)).squeeze(0)
            y = down[e] @ h + (0 if second.bias is None else second.bias[e].double())
            total += weights[t, k].double() * y
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model", MODELS)
def test_full_rank_equals_the_dense_experts_float32(model, implementation, moe):
    dense = moe.dense_experts(model, implementation=implementation)
    hidden, index, weights = moe.routing()
    sketched = SKExperts.from_experts(dense, *moe.full_rank_terms())
    assert sketched.active_implementation == implementation  # follows the shared config
    with torch.no_grad():
        expected = dense(hidden, index, weights)
        got = sketched(hidden, index, weights)
    assert got.dtype == torch.float32 and got.shape == (hidden.shape[0], moe.HIDDEN)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), per_token_reference(sketched, hidden, index, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model", ["mixtral", "gpt_oss"])
def test_full_rank_equals_the_dense_experts_float64_and_bfloat16(model, implementation, moe):
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 3e-2)):
        dense = moe.dense_experts(model, dtype=dtype, implementation="eager")  # dense grouped_mm has no float64
        hidden, index, weights = moe.routing(dtype=dtype)
        sketched = SKExperts.from_experts(dense, *moe.full_rank_terms(), implementation=implementation)
        assert sketched.gate_up_proj.S1.dtype == dtype
        with torch.no_grad():
            expected, got = dense(hidden, index, weights), sketched(hidden, index, weights)
        assert got.dtype == dtype
        scale = expected.abs().max()
        assert float((got - expected).abs().max() / scale) < tol, dtype


@pytest.mark.parametrize("model", ["mixtral", "gpt_oss"])
def test_every_schedule_gives_the_same_function_at_low_rank(model, moe):
    dense = moe.dense_experts(model)
    hidden, index, weights = moe.routing(tokens=13)
    sketched = SKExperts.from_experts(dense, 1, 3)
    outputs = {}
    for implementation in IMPLEMENTATIONS:
        sketched.implementation = implementation
        outputs[implementation] = sketched(hidden, index, weights)
    for implementation in IMPLEMENTATIONS[1:]:
        torch.testing.assert_close(outputs[implementation], outputs["eager"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        outputs["eager"].double(), per_token_reference(sketched, hidden, index, weights), rtol=1e-5, atol=1e-6
    )


def test_svd_fit_is_each_experts_best_rank_2lk_approximation(moe):
    dense = moe.dense_experts("mixtral", dtype=torch.float64)
    num_terms, low_rank = 1, 3
    sketched = SKExperts.from_experts(dense, num_terms, low_rank)
    for name, effective in sketched.effective_weights().items():
        original = getattr(dense, name)
        for e in range(moe.EXPERTS):
            singular = torch.linalg.svdvals(original[e])
            optimal = singular[2 * num_terms * low_rank:].square().sum().sqrt()
            torch.testing.assert_close((effective[e] - original[e]).norm(), optimal, rtol=1e-9, atol=1e-12)


def test_per_expert_gram_fits_each_experts_outputs(moe):
    dense = moe.dense_experts("mixtral", dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(moe.EXPERTS, 40, moe.HIDDEN, dtype=torch.float64, generator=generator) * torch.linspace(0.1, 3, moe.HIDDEN)
    grams = inputs.transpose(1, 2) @ inputs
    plain = SKExperts.from_experts(dense, 1, 2)
    aware = SKExperts.from_experts(dense, 1, 2, gram={"gate_up_proj": grams})
    for e in range(moe.EXPERTS):
        reference = inputs[e] @ dense.gate_up_proj[e].t()

        def error(model):
            return (inputs[e] @ model.effective_weights()["gate_up_proj"][e].t() - reference).norm()

        assert error(aware) < error(plain)
    torch.testing.assert_close(aware.down_proj.S1, plain.down_proj.S1)  # no gram given for it


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_expert_with_no_tokens_and_no_tokens_at_all(implementation, moe):
    dense = moe.dense_experts("mixtral", implementation=implementation)
    sketched = SKExperts.from_experts(dense, *moe.full_rank_terms())
    hidden, index, weights = moe.routing(skip_expert=2)
    assert not (index == 2).any()
    out = sketched(hidden, index, weights)
    torch.testing.assert_close(out, dense(hidden, index, weights), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    for projection in sketched.projections():
        assert torch.count_nonzero(projection.S1.grad[2]) == 0 and torch.count_nonzero(projection.S2.grad[2]) == 0
        assert torch.count_nonzero(projection.S1.grad[0]) > 0
    empty = sketched(hidden[:0], index[:0], weights[:0])
    assert empty.shape == (0, moe.HIDDEN)


def test_swapped_into_a_model_it_follows_set_experts_implementation(moe):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=50, hidden_size=moe.HIDDEN, intermediate_size=moe.INTER, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=moe.EXPERTS, num_experts_per_tok=moe.TOP_K,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    dense_model = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.mlp.experts = SKExperts.from_experts(layer.mlp.experts, *moe.full_rank_terms())
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    for implementation in IMPLEMENTATIONS:
        for m in (model, dense_model):
            m.set_experts_implementation(implementation)
        assert model.model.layers[0].mlp.experts.active_implementation == implementation
        with torch.no_grad():
            torch.testing.assert_close(model(tokens).logits, dense_model(tokens).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["mixtral", "gpt_oss"])
def test_to_dense_is_the_original_class_with_the_effective_weights(model, moe):
    dense = moe.dense_experts(model, implementation="grouped_mm")
    before = {name: p.clone() for name, p in dense.named_parameters()}
    sketched = SKExperts.from_experts(dense, 1, 2)
    assert {name: p for name, p in dense.named_parameters()}.keys() == before.keys()
    for name, p in dense.named_parameters():
        assert torch.equal(p, before[name]), "from_experts changed its argument"
    back = sketched.to_dense()
    assert type(back) is type(dense) and back.config is dense.config
    assert {n: p.shape for n, p in back.named_parameters()} == {n: p.shape for n, p in dense.named_parameters()}
    hidden, index, weights = moe.routing()
    with torch.no_grad():
        torch.testing.assert_close(back(hidden, index, weights), sketched(hidden, index, weights), rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad and not p.is_inference() for p in back.parameters())


def test_state_dict_parameter_counts_and_repr(moe):
    sketched = SKExperts.from_experts(moe.dense_experts("gpt_oss"), 1, 2)
    assert set(sketched.state_dict()) == {
        f"{name}.{factor}" for name in ("gate_up_proj", "down_proj") for factor in ("S1", "U1", "U2", "S2", "bias")
    }
    counts = sketched.parameter_counts()
    assert counts.trainable == sum(p.numel() for p in sketched.parameters())
    assert counts.stored == counts.trainable + sum(b.numel() for b in sketched.buffers())
    assert "num_experts=4, hidden_dim=16, intermediate_dim=12, num_terms=1, low_rank=2" in repr(sketched)


def test_meta_experts_give_a_default_init_or_a_placeholder_to_load_into(moe):
    with torch.device("meta"):
        _, config = moe.MODELS["mixtral"]()
        meta = moe.MODELS["mixtral"]()[0](config)
    fresh = SKExperts(meta, 1, 4, init="sketch", seed=0, device="cpu")
    again = SKExperts(meta, 1, 4, init="sketch", seed=0, device="cpu")
    weight = fresh.effective_weights()["gate_up_proj"]
    assert weight.device.type == "cpu" and torch.isfinite(weight).all()
    torch.testing.assert_close(weight.pow(2).mean().sqrt().item(), (3 * moe.HIDDEN) ** -0.5, rtol=1e-5, atol=0)
    assert torch.equal(weight, again.effective_weights()["gate_up_proj"])
    placeholder = SKExperts(meta, 1, 4)
    assert placeholder.gate_up_proj.S1.is_meta
    loaded = placeholder.to_empty(device="cpu")
    loaded.load_state_dict(fresh.state_dict())
    hidden, index, weights = moe.routing()
    torch.testing.assert_close(loaded(hidden, index, weights), fresh(hidden, index, weights))


def test_bad_arguments_raise_clear_errors_and_change_nothing(moe):
    dense = moe.dense_experts("mixtral")
    with pytest.raises(TypeError, match="nn.Module"):
        SKExperts(dense.gate_up_proj, 1, 2)
    with pytest.raises(TypeError, match="3-D expert weights"):
        SKExperts(nn.Linear(4, 4), 1, 2)
    broken = copy.deepcopy(dense)
    broken.down_proj = nn.Parameter(torch.zeros(moe.EXPERTS, moe.HIDDEN, moe.INTER + 1))
    with pytest.raises(ValueError, match="do not fit together"):
        SKExperts(broken, 1, 2)
    for kwargs, match in (
        (dict(init="random"), "init"), (dict(fit="fast"), "fit"), (dict(implementation="triton"), "implementation"),
        (dict(gram={"up": torch.eye(moe.HIDDEN)}), "gram must map"), (dict(init="sketch", gram={"down_proj": torch.eye(moe.INTER).repeat(moe.EXPERTS, 1, 1)}), "init='svd'"),
    ):
        with pytest.raises(ValueError, match=match):
            SKExperts(dense, 1, 2, **kwargs)
    with pytest.raises(ValueError, match=r"gram must be one Gram per expert"):
        SKExperts(dense, 1, 2, gram={"down_proj": torch.eye(moe.INTER)})
    with pytest.raises(ValueError, match="num_terms"):
        SKExperts(dense, 0, 2)
    parallel = copy.deepcopy(dense)
    parallel._is_expert_parallel = True
    with pytest.raises(ValueError, match="expert-parallel"):
        SKExperts(parallel, 1, 2)
    with pytest.raises(TypeError, match="SKExperts"):
        SKExperts.from_experts(dense, 1, 2).gate_up_proj.to_dense()
    with pytest.raises(TypeError, match="SKExperts"):
        SKStackedLinear.from_dense(nn.Linear(3, 3), 1, 1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_routing_names_the_argument(implementation, moe):
    sketched = SKExperts.from_experts(moe.dense_experts("mixtral"), 1, 2, implementation=implementation)
    hidden, index, weights = moe.routing()
    cases = (
        ((hidden[:, :-1], index, weights), ValueError, "hidden_states must have shape"),
        ((hidden, index.float(), weights), ValueError, "top_k_index must be an integer"),
        ((hidden, index[:-1], weights), ValueError, "top_k_index must be an integer"),
        ((hidden, index, weights[:, :1]), ValueError, "top_k_weights must be a floating"),
        ((hidden, index + moe.EXPERTS, weights), ValueError, r"top_k_index must hold expert indices in \[0, num_experts=4\)"),
        ((hidden, index - moe.EXPERTS, weights), ValueError, r"top_k_index must hold expert indices"),
        ((hidden.double(), index, weights), TypeError, "dtype"),
        ((hidden.numpy(), index, weights), TypeError, "hidden_states must be a Tensor"),
    )
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            sketched(*args)


def test_sizes_give_each_projection_its_own_rank(moe):
    dense = moe.dense_experts("mixtral", dtype=torch.float64)
    sketched = SKExperts.from_experts(dense, 1, 2, sizes={"down_proj": (2, 3)})
    assert sketched.sizes == {"gate_up_proj": (1, 2), "down_proj": (2, 3)}
    assert sketched.down_proj.S1.shape == (moe.EXPERTS, moe.INTER, 6) and sketched.gate_up_proj.S1.shape[-1] == 2
    assert "sizes={'gate_up_proj': (1, 2), 'down_proj': (2, 3)}" in repr(sketched)
    for name, rank in (("gate_up_proj", 4), ("down_proj", 12)):
        effective, original = sketched.effective_weights()[name], getattr(dense, name)
        for e in range(moe.EXPERTS):
            optimal = torch.linalg.svdvals(original[e])[rank:].square().sum().sqrt()
            torch.testing.assert_close((effective[e] - original[e]).norm(), optimal, rtol=1e-9, atol=1e-12)
    for sizes, match in (({"up": (1, 1)}, "sizes must map projection names"), ({"down_proj": (1,)}, "pair"),
                         ({"down_proj": (0, 2)}, "num_terms")):
        with pytest.raises(ValueError, match=match):
            SKExperts(dense, 1, 2, sizes=sizes)


class _NormedExperts(nn.Module):
    """A transformers-style experts module with a post-expert norm and a weight of its own."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 10, 6))
        self.down_proj = nn.Parameter(torch.randn(3, 6, 5))
        self.act_fn = nn.SiLU()
        self.post_expert_norm = nn.LayerNorm(6)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.has_post_expert_norm = True

    def _apply_gate(self, hidden):
        gate, up = hidden.chunk(2, dim=-1)
        return self.act_fn(gate) * up * self.temperature


def test_the_shell_is_no_child_but_what_it_owns_is_registered_and_follows_moves():
    dense = _NormedExperts()
    with torch.no_grad():
        dense.post_expert_norm.weight.uniform_(0.5, 2.0)
    sketched = SKExperts.from_experts(dense, 2, 3, implementation="eager")
    assert all(type(child) is not _NormedExperts for child in sketched.modules())
    assert {"post_expert_norm.weight", "post_expert_norm.bias", "temperature"} <= set(sketched.state_dict())
    assert sketched.shell.post_expert_norm is sketched.post_expert_norm and sketched.shell.temperature is sketched.temperature
    hidden = torch.randn(7, 6)
    index = torch.randint(0, 3, (7, 2))
    weights = torch.rand(7, 2)
    with torch.no_grad():
        reference = sketched(hidden, index, weights)
        by_token = torch.stack([
            sum(weights[t, k] * dense.post_expert_norm(dense._apply_gate(dense.gate_up_proj[e] @ hidden[t]) @ dense.down_proj[e].t())
                for k, e in enumerate(index[t].tolist()))
            for t in range(7)
        ])
        torch.testing.assert_close(reference, by_token, rtol=1e-4, atol=1e-5)  # 2Lk = 12: every expert exact
        doubled = sketched.double()
        torch.testing.assert_close(doubled(hidden.double(), index, weights.double()), reference.double(), rtol=1e-5, atol=1e-6)
    assert doubled.shell.temperature.dtype == torch.float64 and doubled.shell.post_expert_norm.weight.dtype == torch.float64
    with torch.device("meta"):
        meta = _NormedExperts()
    placeholder = SKExperts(meta, 2, 3, device="meta", implementation="eager")
    loaded = placeholder.to_empty(device="cpu")
    loaded.load_state_dict(sketched.float().state_dict())
    assert loaded.shell.temperature is loaded.temperature and not loaded.shell.temperature.is_meta
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, index, weights), reference)
