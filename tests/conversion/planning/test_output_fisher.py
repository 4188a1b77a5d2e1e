"""The output Fisher of each layer: its expectation is ``Σ_t Jᵀ(diag p − p pᵀ)J`` (checked by
Monte Carlo on a model whose Jacobian is known), padded tokens count nothing, wide layers keep
the diagonal, and a model without logits is refused and left as it was."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.conversion.calibration.batches import run_batch
from panther_lite.conversion.planning.output_fisher import fisher_importances, output_fishers


class _Logits(nn.Module):
    """``{"logits": head(layer(x))}``: the Fisher at ``layer``'s output is ``headᵀ F_softmax head``."""

    def __init__(self, gen):
        super().__init__()
        self.layer = nn.Linear(5, 4).double()
        self.head = nn.Linear(4, 7, bias=False).double()
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(7, 4, generator=gen, dtype=torch.float64))

    def forward(self, x):
        return {"logits": self.head(self.layer(x))}


def _exact_fisher(model, x):
    with torch.no_grad():
        p = torch.softmax(model(x)["logits"].reshape(-1, 7), -1)
    softmax_fisher = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    head = model.head.weight
    return (head.t() @ softmax_fisher @ head).sum(0)


@pytest.mark.parametrize("full_up_to", [4096, 3])
def test_the_sampled_fisher_converges_to_the_exact_one(full_up_to):
    gen = torch.Generator().manual_seed(0)
    model = _Logits(gen)
    x = torch.randn(40, 5, 5, generator=gen, dtype=torch.float64)
    repeats = 60  # 12,000 draws
    found = output_fishers(model, {"layer": model.layer}, [lambda m: m(x)] * repeats, full_up_to=full_up_to)
    exact = _exact_fisher(model, x)
    if full_up_to < 4:  # wider than full_up_to: its diagonal
        assert found["layer"].shape == (4,)
        exact = exact.diagonal()
    relative = (found["layer"] / repeats - exact).norm() / exact.norm()
    assert relative < 0.05


def test_the_same_seed_gives_the_same_fisher_and_another_seed_another():
    gen = torch.Generator().manual_seed(1)
    model = _Logits(gen)
    x = torch.randn(1, 6, 5, generator=gen, dtype=torch.float64)
    runs = [lambda m: m(x)] * 3
    first = output_fishers(model, {"layer": model.layer}, runs, seed=3)["layer"]
    assert torch.equal(first, output_fishers(model, {"layer": model.layer}, runs, seed=3)["layer"])
    assert not torch.equal(first, output_fishers(model, {"layer": model.layer}, runs, seed=4)["layer"])


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16)).eval()


def test_padded_tokens_count_nothing_in_a_causal_lm():
    model = _tiny_llama()
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    other = ids.clone()
    other[1, 6:] = (other[1, 6:] + 7) % 40  # different padding content
    layers = {name: module for name, module in model.named_modules() if name.endswith(("q_proj", "k_proj", "down_proj"))}

    def fishers(tokens):
        batch = {"input_ids": tokens, "attention_mask": mask}
        return output_fishers(model, layers, [lambda m: run_batch(m, batch)] * 2)

    padded, repadded = fishers(ids), fishers(other)
    assert set(padded) == set(layers)
    assert padded["model.layers.0.self_attn.k_proj"].shape == (16, 16)  # 2 key/value heads of 8
    for name in layers:
        torch.testing.assert_close(padded[name], repadded[name], rtol=1e-9, atol=1e-12)
        assert float(padded[name].trace()) > 0


def test_a_model_without_logits_is_refused_and_left_as_it_was():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).train()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no next-token logits"):
        output_fishers(model, {"0": model[0]}, [lambda m: m(torch.randn(5, 4))])
    assert model.training and all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())
    assert not model[0]._forward_hooks  # the taps are gone


def test_fisher_weighted_layers_weigh_their_totals_and_the_others_their_gains_in_the_same_units():
    gains, totals = {"a": 2.0, "b": 4.0, "c": 1.0, "d": 0.5}, {"a": 6.0, "b": 8.0, "e": 3.0}
    weights = fisher_importances(["a", "b", "c", "d", "e"], gains, totals)
    assert weights == {"a": 6.0, "b": 8.0, "c": 3.0, "d": 1.5, "e": 3.0}  # gains times the median of 6/2, 8/4, 3/1
    assert fisher_importances(["a", "c"], gains, {}) == gains  # no Fisher: the measured gains as they were


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 100), min_size=2, max_size=6), st.floats(1e-3, 1e3))
def test_the_plans_weights_do_not_depend_on_the_fishers_units(values, scale):
    names = [f"layer{i}" for i in range(len(values))]
    gains = {name: value for name, value in zip(names, reversed(values))}
    totals = {name: value for name, value in zip(names[::2], values[::2])}
    weights = fisher_importances(names, gains, totals)
    scaled = fisher_importances(names, gains, {name: scale * total for name, total in totals.items()})
    assert scaled == pytest.approx({name: scale * weight for name, weight in weights.items()}, rel=1e-9)
