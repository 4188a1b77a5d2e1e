"""The gains of the global allocation under the next-token KL: a layer that moves logits no
prediction depends on gets no weight, unlike under the plain norm."""
import pytest
import torch
import torch.nn as nn
from transformers.modeling_outputs import CausalLMOutput

from panther_lite import ConvertConfig
from panther_lite.conversion.planning.sensitivity import block_output_gains, output_gains
from panther_lite.conversion.selection import select_layers


class _TwoPaths(nn.Module):
    """Logits = head(x) + shift(x) broadcast over the vocabulary: ``shift`` moves every logit of a
    token alike, which no next-token distribution feels."""

    def __init__(self, width=8, vocab=11):
        super().__init__()
        self.head, self.shift = nn.Linear(width, vocab), nn.Linear(width, 1)
        self.blocks = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return CausalLMOutput(logits=self.head(x) + self.shift(x))


def _model():
    torch.manual_seed(0)
    return _TwoPaths(), torch.randn(3, 4, 8)


def test_kl_gains_give_no_weight_to_a_layer_only_shifting_all_logits():
    model, x = _model()
    records = [r for r in select_layers(model, None, None, None) if r.name in ("head", "shift")]
    kl = output_gains(model, records, lambda m: m(x), "kl")
    norm = output_gains(model, records, lambda m: m(x), "norm")
    assert kl["shift"] < 1e-9 * kl["head"] and kl["head"] > 0
    assert norm["shift"] > 1e-3 * norm["head"]
    assert output_gains(model, records, lambda m: m(x), "auto") == kl


def test_kl_block_gains_weigh_a_block_by_what_reaches_the_predictions():
    """A block whose output reaches the logits only through ``shift`` gets no KL gain."""
    model, x = _model()
    reaching = block_output_gains(model, list(model.blocks), lambda m: m(x), "kl")
    model.head.weight.data.zero_()  # the predictions depend on x through shift alone: a constant per token
    shifting = block_output_gains(model, list(model.blocks), lambda m: m(x), "kl")
    assert max(shifting) < 1e-9 * min(reaching)
    assert min(block_output_gains(model, list(model.blocks), lambda m: m(x), "norm")) > 1e-3 * min(reaching)


def test_sensitivity_is_checked_by_the_config():
    with pytest.raises(ValueError, match="sensitivity"):
        ConvertConfig(param_ratio=0.5, allocation="global", sensitivity="fisher")
    assert ConvertConfig(param_ratio=0.5).sensitivity == "auto"


@pytest.mark.parametrize("sensitivity", ["norm", "kl"])
def test_the_configs_sensitivity_reaches_every_gain_measurement(sensitivity, monkeypatch):
    """convert's block pipeline measures the blocks' gains and the layers' own gains in the
    metric the config names (the blocks' outputs being hidden states, their inner probes fall
    back to the norm whatever is asked)."""
    import transformers

    import panther_lite
    from panther_lite.conversion.planning import sensitivity as module

    asked = []
    real = module.probe_output
    monkeypatch.setattr(module, "probe_output", lambda output, mask, metric: asked.append(metric) or real(output, mask, metric))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16)).eval()
    batch = {"input_ids": torch.randint(0, 40, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    panther_lite.convert(model, param_ratio=0.6, allocation="global", sensitivity=sensitivity,
                         calibration_data=[batch], progress=False)
    assert asked and set(asked) == {sensitivity}
