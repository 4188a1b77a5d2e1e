"""PEFT adapters and conversion: adapter modules, tuner layers' base layers and
modules_to_save copies are skipped with a reason; the rest of the model converts and PEFT's
forward, training and merge_and_unload keep working."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

peft = pytest.importorskip("peft")

import panther_lite  # noqa: E402
from panther_lite.conversion.adapters import adapter_skip_reason  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402


class _Net(nn.Module):
    """Attention-like projection, an MLP layer and a head: (batch, 32) -> (batch, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.mlp = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mlp(self.q(x))))


def _lora_model(**config) -> nn.Module:
    torch.manual_seed(0)
    # init_lora_weights=False: lora_B is random, so the adapter changes the output
    lora = peft.LoraConfig(r=2, target_modules=["q"], init_lora_weights=False, **config)
    return peft.get_peft_model(_Net(), lora)


def _reasons(model: nn.Module) -> dict:
    return {fqn: adapter_skip_reason(module, fqn) for fqn, module in model.named_modules()}


def test_plain_modules_have_no_reason():
    model = _Net()
    assert all(reason is None for reason in _reasons(model).values())


def test_without_peft_loaded_nothing_is_an_adapter_and_peft_stays_unimported(monkeypatch):
    for name in [name for name in sys.modules if name == "peft" or name.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)
    assert adapter_skip_reason(nn.Linear(2, 2), "q.lora_A.default") is None
    assert adapter_skip_reason(nn.Linear(2, 2), "q.base_layer") is None
    assert "peft" not in sys.modules


def test_lora_modules_are_named_with_a_reason():
    reasons = _reasons(_lora_model(modules_to_save=["head"]))
    prefix = "base_model.model."
    assert "tuner layer" in reasons[prefix + "q"]
    assert "base layer" in reasons[prefix + "q.base_layer"]
    for adapter in ("lora_A", "lora_B"):
        assert f"adapter module ({adapter})" in reasons[f"{prefix}q.{adapter}.default"]
    assert "modules_to_save" in reasons[prefix + "head.modules_to_save.default"]
    assert "original_module" in reasons[prefix + "head.original_module"]
    assert reasons[prefix + "mlp"] is None


@pytest.mark.parametrize(
    "config",
    [
        peft.LoraConfig(r=2, target_modules=["q"], use_dora=True),
        peft.IA3Config(target_modules=["q", "mlp"], feedforward_modules=["mlp"]),
        peft.LoHaConfig(r=2, target_modules=["q"]),
    ],
    ids=["dora", "ia3", "loha"],
)
def test_other_tuners_are_recognised(config):
    model = peft.get_peft_model(_Net(), config)
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert {"base_model.model.q.base_layer", "base_model.model.head"} <= {fqn for fqn, _ in linears}
    for fqn, module in linears:
        inside_tuner = any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in _ancestors(model, fqn))
        assert (adapter_skip_reason(module, fqn) is not None) == inside_tuner, fqn


def _ancestors(model: nn.Module, fqn: str):
    """The module at ``fqn`` and every module above it."""
    parts = fqn.split(".") if fqn else []
    return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]


def test_convert_skips_adapters_and_merge_still_works():
    model = _lora_model()
    x = torch.randn(8, 32)
    report = panther_lite.convert(model, target_modules="all-linear", num_terms=1, low_rank=2)
    status = dict(zip(report["name"], report["status"]))
    reason = dict(zip(report["name"], report["reason"]))
    assert status["base_model.model.mlp"] == "converted"
    for fqn in ("q.base_layer", "q.lora_A.default", "q.lora_B.default"):
        assert status["base_model.model." + fqn] == "skipped"
        assert "PEFT" in reason["base_model.model." + fqn]
    assert isinstance(model.base_model.model.mlp, SKLinear)

    out = model(x)
    out.square().mean().backward()
    lora_grad = model.base_model.model.q.lora_A["default"].weight.grad
    assert lora_grad is not None and lora_grad.abs().sum() > 0

    with torch.no_grad():
        expected = model(x)
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-5)
    assert type(merged.q) is nn.Linear and isinstance(merged.mlp, SKLinear)


def test_merge_then_convert_converts_the_merged_layers():
    model = _lora_model().merge_and_unload()
    report = panther_lite.convert(model, target_modules=["q", "mlp"], num_terms=1, low_rank=2)
    assert list(report["status"]) == ["converted", "converted"]


def test_peft_refuses_sketched_targets():
    # the documented order: compress, then fine-tune the S factors; LoRA cannot wrap a sketched layer
    model = _Net()
    panther_lite.convert(model, target_modules=["q"], num_terms=1, low_rank=2)
    with pytest.raises(ValueError, match="SKLinear"):
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q"]))
