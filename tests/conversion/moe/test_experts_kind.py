"""Converting transformers' fused experts modules (the ``Experts`` kind) on a standalone
Mixtral sparse-MoE block with a fixed router: per-expert calibration from the routed rows
(checked against the rows themselves), data-free fits of experts with too few rows, a report
row per projection with per-expert figures, sizes per projection, and every workflow that
works for SKLinear — pipelines, sequential, refinement, tune, save/load, meta rebuild, ONNX."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import panther_lite  # noqa: E402
from panther_lite.conversion.calibration.shrinkage import RowMoments, shrink, shrinkage_intensity  # noqa: E402
from panther_lite.nn import SKExperts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HIDDEN, INTER, EXPERTS, TOKENS = 16, 24, 4, 40
RARE = 3  # the expert the fixed router sends RARE_ROWS tokens, fewer than its inputs
RARE_ROWS = 5


class FixedRouter(nn.Module):
    """A router with no weights: token ``t`` goes to experts ``t % 3`` and ``(t + 1) % 3``,
    except the first RARE_ROWS tokens of each sequence, whose second expert is RARE."""

    top_k = 2

    def forward(self, hidden_states):
        tokens = hidden_states.shape[0]
        t = torch.arange(tokens)
        first, second = t % 3, (t + 1) % 3
        second = torch.where(t % TOKENS < RARE_ROWS, torch.full_like(t, RARE), second)
        index = torch.stack([first, second], dim=1)
        weights = torch.tensor([0.75, 0.25]).expand(tokens, 2).to(hidden_states.dtype)
        return None, weights, index


def moe_block(seed: int = 0, dtype=torch.float64) -> nn.Module:
    """``nn.Sequential(Linear, MixtralSparseMoeBlock with FixedRouter)`` on ``(1, TOKENS, HIDDEN)``
    inputs, weights N(0, 0.3²), experts on the eager implementation."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = MixtralSparseMoeBlock(config)
    block.gate = FixedRouter()
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), block)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape))
    return model.to(dtype).eval()


def data(count: int = 3, seed: int = 1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.2, 3.0, HIDDEN, dtype=torch.float64)
    return [(torch.randn(1, TOKENS, HIDDEN, generator=generator, dtype=torch.float64) * scales).to(dtype) for _ in range(count)]


def routed_rows(model: nn.Module, batches):
    """Per expert, the rows routed to it: ``(hidden inputs, activations into down_proj)`` by a
    plain PyTorch reference (the dense expert weights applied token by token)."""
    experts = model[1].experts
    inputs = {e: [] for e in range(EXPERTS)}
    with torch.no_grad():
        for batch in batches:
            hidden = model[0](batch).reshape(-1, HIDDEN)
            _, _, index = model[1].gate(hidden)
            for t in range(hidden.shape[0]):
                for e in index[t].tolist():
                    inputs[e].append(hidden[t])
    rows = {}
    for e, found in inputs.items():
        x = torch.stack(found)
        gate, up = (x @ experts.gate_up_proj[e].detach().t()).chunk(2, dim=-1)
        rows[e] = (x, experts.act_fn(gate) * up)
    return rows


@pytest.fixture(scope="module")
def converted():
    model = moe_block()
    dense = copy.deepcopy(model)
    batches = data()
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, progress=False)
    return model, dense, batches, report


def test_report_has_a_row_per_projection_with_per_expert_figures(converted):
    model, _, _, report = converted
    rows = report.set_index("name")
    sketched = model[1].experts
    assert isinstance(sketched, SKExperts)
    for projection in ("gate_up_proj", "down_proj"):
        row = rows.loc[f"1.experts.{projection}"]
        layer = getattr(sketched, projection)
        assert row["kind"] == "Experts" and row["status"] == "converted" and row["init"] == "calibrated"
        assert (row["num_terms"], row["low_rank"]) == (layer.num_terms, layer.low_rank) == sketched.sizes[projection]
        assert row["shape"] == tuple(layer.dense_weight_shape) and row["experts"] == EXPERTS
        assert row["stored_params"] == layer.parameter_counts().stored <= 0.5 * row["dense_params"]
        assert len(row["expert_output_errors"]) == len(row["expert_weight_errors"]) == EXPERTS
    assert list(rows.loc["1.experts.gate_up_proj", "expert_rows"]) == [
        sum((t % 3 == e) + ((t + 1) % 3 == e) * (t >= RARE_ROWS) for t in range(TOKENS)) * 3 for e in range(3)
    ] + [3 * RARE_ROWS]


def test_each_expert_is_calibrated_on_the_rows_routed_to_it(converted):
    model, dense, batches, report = converted
    rows, by_name = routed_rows(dense, batches), report.set_index("name")
    with torch.no_grad():
        sketched = model[1].experts.effective_weights()
    for index, projection in enumerate(("gate_up_proj", "down_proj")):
        weight = getattr(dense[1].experts, projection).detach()
        expected = []
        for e in range(EXPERTS):
            x = rows[e][index]
            reference = x @ weight[e].t()
            expected.append(float((x @ sketched[projection][e].t() - reference).norm() / reference.norm()))
        got = by_name.loc[f"1.experts.{projection}", "expert_output_errors"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=1e-9)


def test_an_expert_with_fewer_rows_than_inputs_is_fitted_data_free_and_reported(converted):
    model, dense, batches, report = converted
    by_name = report.set_index("name")
    for projection, fan_in in (("gate_up_proj", HIDDEN), ("down_proj", INTER)):
        row = by_name.loc[f"1.experts.{projection}"]
        assert list(row["data_free_experts"]) == [RARE]
        assert f"experts [{RARE}] received fewer calibration rows than the {fan_in} inputs of {projection}" in row["reason"]
        assert "data-free" in row["reason"]
    sizes = model[1].experts.sizes
    plain = SKExperts.from_experts(dense[1].experts, 1, 1, sizes=sizes)  # fitted to the weights alone
    calibrated = SKExperts.from_experts(dense[1].experts, 1, 1, sizes=sizes, gram=_grams(dense, batches))
    for projection, got in model[1].experts.effective_weights().items():
        free = plain.effective_weights()[projection]
        torch.testing.assert_close(got[RARE], free[RARE], rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(got[0], calibrated.effective_weights()[projection][0], rtol=1e-6, atol=1e-8)
        assert not torch.allclose(got[0], free[0], atol=1e-4)  # the others are calibrated


def _grams(dense, batches):
    """The Grams the fit whitens by: each expert's routed rows' Gram, shrunk by its Ledoit–Wolf
    intensity, and the identity for the rare expert (data-free)."""
    rows, grams = routed_rows(dense, batches), {}
    for index, name in enumerate(("gate_up_proj", "down_proj")):
        stack = []
        for e in range(EXPERTS):
            x = rows[e][index]
            moments = RowMoments()
            moments.add(x)
            gram = x.t() @ x
            stack.append(torch.eye(x.shape[1], dtype=x.dtype) if e == RARE else shrink(gram, shrinkage_intensity(gram, moments)))
        grams[name] = torch.stack(stack)
    return grams


def test_calibrated_fits_beat_weight_only_fits_on_the_routed_rows(converted):
    model, dense, batches, _ = converted
    rows = routed_rows(dense, batches)
    plain = SKExperts.from_experts(dense[1].experts, 1, 1, sizes=model[1].experts.sizes).effective_weights()
    aware = model[1].experts.effective_weights()
    for index, projection in enumerate(("gate_up_proj", "down_proj")):
        weight = getattr(dense[1].experts, projection)
        for e in range(3):
            x = rows[e][index]
            assert (x @ (aware[projection][e] - weight[e]).t()).norm() < (x @ (plain[projection][e] - weight[e]).t()).norm()


def test_block_and_whole_model_pipelines_give_the_same_fits(moe):
    first, second = moe.build("mixtral"), moe.build("mixtral")
    report = panther_lite.convert(first, param_ratio=0.5, calibration_data=moe.batches(), progress=False)
    panther_lite.convert(second, param_ratio=0.5, calibration_data=moe.batches(), blocks=False, progress=False)
    assert report.attrs["pipeline"].startswith("block pipeline")
    for name, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[name]), name


def test_rank_pattern_sizes_one_projection_and_target_modules_all_linear_includes_experts():
    model = moe_block()
    report = panther_lite.convert(
        model, param_ratio=0.5, rank_pattern={"down_proj": (1, 2)}, target_modules="all-linear", calibration_data=data(),
        progress=False,
    )
    sizes = model[1].experts.sizes
    assert sizes["down_proj"] == (1, 2) and sizes["gate_up_proj"] != (1, 2)
    assert set(report["kind"]) == {"Linear", "Experts"}
    with pytest.raises(ValueError, match="rank_pattern keys"):
        panther_lite.convert(moe_block(), param_ratio=0.5, rank_pattern={"up_proj$": (1, 2)}, progress=False)


def test_experts_can_be_excluded_and_expert_parallel_modules_are_skipped():
    model = moe_block()
    report = panther_lite.convert(model, param_ratio=0.5, exclude_modules=["experts"], progress=False)
    assert list(report["name"]) == ["0"] and type(model[1].experts).__name__ == "MixtralExperts"
    model = moe_block()
    model[1].experts._is_expert_parallel = True
    report = panther_lite.convert(model, param_ratio=0.5, progress=False).set_index("name")
    assert report.loc["1.experts.gate_up_proj", "status"] == "skipped"
    assert "expert-parallel" in report.loc["1.experts.down_proj", "reason"]


def test_sequential_fits_calibrate_experts_on_their_current_inputs():
    model, batches = moe_block(), data()
    dense = copy.deepcopy(model)
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, sequential=True, progress=False)
    rows = report.set_index("name")
    assert rows.loc["0", "init"] == "sequential" and rows.loc["1.experts.gate_up_proj", "init"] == "calibrated"
    # the experts' Grams come from the converted first layer's outputs: the same fit as calibrating
    # a model whose first layer is that converted one
    reference = copy.deepcopy(dense)
    reference[0] = copy.deepcopy(model[0])
    expected = SKExperts.from_experts(
        reference[1].experts, 1, 1, sizes=model[1].experts.sizes, gram=_grams(reference, batches)
    ).effective_weights()
    for projection, got in model[1].experts.effective_weights().items():
        torch.testing.assert_close(got[0], expected[projection][0], rtol=1e-6, atol=1e-8)


def test_refinement_trains_the_experts_and_measures_them_again(moe):
    model = moe.build("mixtral")
    dense = copy.deepcopy(model)
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=moe.batches(), refine=True, progress=False)
    experts = report[report["kind"] == "Experts"]
    assert experts["init"].str.endswith("+refined").any()  # a block is refined when that lowers its error
    for _, row in experts.iterrows():
        module_name, _, projection = row["name"].rpartition(".")
        effective = model.get_submodule(module_name).effective_weights()[projection].detach()
        original = getattr(dense.get_submodule(module_name), projection).detach()
        per_expert = [float((effective[e] - original[e]).norm() / original[e].norm()) for e in range(moe.EXPERTS)]
        assert row["weight_error"] == pytest.approx(float((effective - original).norm() / original.norm()), rel=1e-5)
        assert list(row["expert_weight_errors"]) == pytest.approx(per_expert, rel=1e-5)


def test_a_global_budget_of_one_keeps_the_experts_dense_and_a_small_one_sketches_them():
    report = panther_lite.convert(moe_block(), param_ratio=1.0, allocation="global", calibration_data=data(), progress=False)
    assert (report["status"] == "kept dense").all()
    model = moe_block()
    report = panther_lite.convert(model, param_ratio=0.3, allocation="global", calibration_data=data(), progress=False)
    experts = report[report["kind"] == "Experts"]
    assert (experts["status"] == "converted").all() and isinstance(model[1].experts, SKExperts)
    assert report["stored_params"].sum() <= 0.3 * report["dense_params"].sum()
