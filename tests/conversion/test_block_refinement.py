"""``convert(refine=...)``: block-wise refinement inside the block pipeline (per-block errors in
the report, only the sketched layers trained, flags restored, clear errors, nothing changed
on a refused call)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import panther_lite  # noqa: E402
from panther_lite.conversion.block_refinement import REFINEMENT_COLUMNS  # noqa: E402
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


def _relative_error(model, reference, batches) -> float:
    with torch.no_grad():
        squared = sum(float((model(**b).logits - reference(**b).logits).square().sum()) for b in batches)
        return (squared / sum(float(reference(**b).logits.square().sum()) for b in batches)) ** 0.5


OPTIONS = dict(target_modules="all-linear", exclude_modules=["lm_head"], param_ratio=0.3, progress=False)


def _convert(model, **kwargs):
    return panther_lite.convert(model, calibration_data=_batches(8), **OPTIONS, **kwargs)


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


def test_refinement_lowers_the_models_error_on_unseen_batches():
    model = _llama()
    plain, refined = copy.deepcopy(model), copy.deepcopy(model)
    panther_lite.convert(plain, calibration_data=_batches(24), **OPTIONS)
    panther_lite.convert(refined, calibration_data=_batches(24), refine={"max_steps": 50, "lr": 3e-3}, **OPTIONS)
    unseen = _batches(4, seed=99)
    assert _relative_error(refined, model, unseen) < _relative_error(plain, model, unseen)


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
