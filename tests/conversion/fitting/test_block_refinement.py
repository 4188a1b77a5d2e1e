"""``convert(refine=...)``: block-wise refinement inside the block pipeline (per-block errors in
the report, only the layers just fitted trained, in float32 for bf16, flags restored, the refined
block feeding the next under sequential, clear errors, nothing changed after a failure)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import panther_lite  # noqa: E402
import panther_lite.conversion.fitting.block_refinement  # noqa: E402
from panther_lite.conversion.fitting.block_refinement import REFINEMENT_COLUMNS, BlockRefiner  # noqa: E402
from panther_lite.conversion.pipelines.blocks import hidden_states  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

VOCAB, HIDDEN, LAYERS = 64, 32, 3
pytestmark = pytest.mark.usefixtures("one_thread")


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


def _batches(count: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=generator)} for _ in range(count)]


OPTIONS = dict(target_modules="all-linear", exclude_modules=["lm_head"], param_ratio=0.3, progress=False)


def _convert(model, **kwargs):
    return panther_lite.convert(model, calibration_data=_batches(8), **{**OPTIONS, **kwargs})


@pytest.mark.parametrize("sequential", [False, True])
def test_each_block_is_refined_and_reported_and_only_its_sketched_layers_change(sequential):
    model = _llama()
    plain, refined = copy.deepcopy(model), copy.deepcopy(model)
    _convert(plain, sequential=sequential)
    report = _convert(refined, sequential=sequential, refine={"max_steps": 10, "lr": 1e-3, "patience": 5})
    rows = report.attrs["refinement"]
    assert [row["block"] for row in rows] == list(range(LAYERS))
    assert [row["name"] for row in rows] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert all(set(row) == set(REFINEMENT_COLUMNS) for row in rows)
    assert all(row["error_after"] <= row["error_before"] for row in rows)
    assert any(row["error_after"] < row["error_before"] and row["steps"] > 0 for row in rows)
    original, plain_parameters = dict(model.named_parameters()), dict(plain.named_parameters())
    for name, parameter in refined.named_parameters():
        if name in original:  # not converted: norms, embeddings, lm_head
            assert torch.equal(parameter, original[name]), name
    assert all(p.requires_grad and p.grad is None for p in refined.parameters())
    assert not any(module.training for module in refined.modules())
    changed = [name for name, p in refined.named_parameters() if not torch.equal(p, plain_parameters[name])]
    assert changed and all(name.endswith(("S1", "S2", "bias")) for name in changed)


def test_refinement_lowers_the_models_error_on_unseen_batches(logits_error):
    model = _llama()
    plain, refined = copy.deepcopy(model), copy.deepcopy(model)
    panther_lite.convert(plain, calibration_data=_batches(24), **OPTIONS)
    panther_lite.convert(refined, calibration_data=_batches(24), refine={"max_steps": 50, "lr": 3e-3}, **OPTIONS)
    unseen = _batches(4, seed=99)
    assert logits_error(refined, model, unseen) < logits_error(plain, model, unseen)


def test_without_refine_the_report_has_no_refinement():
    assert "refinement" not in _convert(_llama()).attrs


def test_refine_without_a_block_list_is_refused_and_nothing_changes():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="refine refines block by block, but this convert runs on the whole model"):
        panther_lite.convert(model, param_ratio=0.5, calibration_data=[torch.randn(8, 16)], refine=True)
    assert all(isinstance(layer, (nn.Linear, nn.ReLU)) for layer in model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "refine, error, message",
    [
        ("yes", TypeError, "refine must be True, False or a dict"),
        ({"steps": 3}, ValueError, r"unknown setting\(s\) \['steps'\]"),
        ({"max_steps": 0}, ValueError, "refine\\['max_steps'\\]"),
        ({"lr": -1.0}, ValueError, "refine: lr must be a positive finite number"),
        ({"holdout": 1.0}, ValueError, "refine: holdout must be a fraction"),
    ],
)
def test_bad_refine_settings_are_named_before_anything_changes(refine, error, message):
    model = _llama()
    with pytest.raises(error, match=message):
        _convert(model, refine=refine)
    assert not any(isinstance(module, SKLinear) for module in model.modules())


def test_layers_an_earlier_conversion_made_are_not_refined():
    model = _llama()
    _convert(model, target_modules=["q_proj"], exclude_modules=None)
    earlier = {n: p.clone() for n, p in model.named_parameters() if "q_proj" in n}
    report = _convert(model, target_modules=["k_proj"], exclude_modules=None, refine={"max_steps": 5})
    assert len(report.attrs["refinement"]) == LAYERS
    assert all(torch.equal(p, earlier[n]) for n, p in model.named_parameters() if "q_proj" in n)
    assert set(report.loc[report["status"] == "converted", "init"]) <= {"calibrated", "calibrated+refined"}
    assert "calibrated+refined" in set(report["init"])


def test_a_failure_while_refining_leaves_the_model_as_it_was(monkeypatch):
    model = _llama().train()
    state = copy.deepcopy(model.state_dict())
    refined = []

    def fail_on_the_second_block(parameters, predict, targets, **settings):
        if refined:
            raise RuntimeError("interrupted")
        refined.append(block_refinement_refine(parameters, predict, targets, **settings))
        return refined[-1]

    block_refinement_refine = panther_lite.conversion.fitting.block_refinement.refine_block
    monkeypatch.setattr(panther_lite.conversion.fitting.block_refinement, "refine_block", fail_on_the_second_block)
    with pytest.raises(RuntimeError, match="interrupted"):
        _convert(model, refine={"max_steps": 5})
    assert refined and refined[0].steps > 0
    assert not any(isinstance(module, SKLinear) for module in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert all(module.training for module in model.modules())


def test_with_sequential_the_refined_block_feeds_the_next(monkeypatch):
    seen = {}
    refine = BlockRefiner.__call__

    def spy(self, fitted):
        refine(self, fitted)
        with torch.no_grad():
            outputs = [fitted.predict(i) for i in range(len(fitted.calls))]
        seen[fitted.index] = (outputs, [hidden_states(call) for call in fitted.calls])

    monkeypatch.setattr(BlockRefiner, "__call__", spy)
    _convert(_llama(), sequential=True, refine={"max_steps": 10})
    for block in range(LAYERS - 1):
        for output, next_input in zip(seen[block][0], seen[block + 1][1]):
            torch.testing.assert_close(next_input, output, rtol=0, atol=0)


def test_a_bfloat16_model_is_refined_in_float32_and_stays_bfloat16(monkeypatch):
    dtypes = []
    refine = panther_lite.conversion.fitting.block_refinement.refine_block

    def spy(parameters, predict, targets, **settings):
        dtypes.append(({p.dtype for p in parameters}, predict(0).dtype))
        return refine(parameters, predict, targets, **settings)

    monkeypatch.setattr(panther_lite.conversion.fitting.block_refinement, "refine_block", spy)
    model = _llama().to(torch.bfloat16)
    report = _convert(model, refine={"max_steps": 10, "lr": 3e-3})
    assert dtypes == [({torch.float32}, torch.float32)] * LAYERS
    assert any(row["error_after"] < row["error_before"] for row in report.attrs["refinement"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.grad is None for p in model.parameters())
