"""LoRA (PEFT) on a compressed model: ``get_peft_model(compressed, sketched_lora(LoraConfig(...)))``
wraps the sketched layers, trains the adapters only, saves and reloads them with equal outputs, and
``merge_and_unload`` folds them exactly into the sketched layers (grown rank) and unmerge undoes it."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import panther_lite  # noqa: E402
from panther_lite.lora import SKLinearLora, cut_to_low_rank, grow_by_low_rank, sketched_lora  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
VOCAB, TARGETS = 64, ["q_proj", "v_proj", "down_proj"]


def _compressed():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16)).eval()  # fmt: skip
    panther_lite.convert(model, num_terms=2, low_rank=2)
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _trained(model, steps: int = 5):
    config = sketched_lora(peft.LoraConfig(r=3, lora_alpha=6, target_modules=TARGETS))
    lora = peft.get_peft_model(model, config).train()
    trainable = [p for p in lora.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = lora(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return lora.eval(), trainable, losses


def test_lora_trains_only_the_adapters_on_sketched_layers():
    model = _compressed()
    factors = {name: p.detach().clone() for name, p in model.named_parameters()}
    lora, trainable, losses = _trained(model)
    wrapped = [m for m in lora.modules() if isinstance(m, SKLinearLora)]
    assert len(wrapped) == 2 * len(TARGETS) and all(isinstance(m.get_base_layer(), SKLinear) for m in wrapped)
    assert trainable and all("lora_" in name for name, p in lora.named_parameters() if p.requires_grad)
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, factors[name]) for name, p in model.named_parameters() if "lora_" not in name
               and name in factors)


def test_adapters_save_reload_and_merge_into_the_sketched_layers(tmp_path):
    lora, _, _ = _trained(_compressed())
    expected = _logits(lora)
    lora.save_pretrained(tmp_path / "adapters")
    panther_lite.save_pretrained(_compressed(), tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = sketched_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapters"))
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters", config=config).eval()
    assert torch.equal(_logits(reloaded), expected)
    merged = reloaded.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert type(q_proj) is SKLinear and q_proj.low_rank == 2 + 2  # r=3 over L=2 terms: ceil(3/2) more
    assert not any(isinstance(m, SKLinearLora) for m in merged.modules())
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-5, atol=1e-5)


def test_unmerge_gives_the_layer_back():
    lora, _, _ = _trained(_compressed())
    expected = _logits(lora)
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    before = {name: t.clone() for name, t in layer.get_base_layer().state_dict().items()}
    lora.merge_adapter()
    torch.testing.assert_close(_logits(lora), expected, rtol=1e-5, atol=1e-5)
    lora.unmerge_adapter()
    after = layer.get_base_layer().state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(_logits(lora), expected)


def test_grow_adds_exactly_the_low_rank_product():
    torch.manual_seed(0)
    layer = SKLinear(48, 32, num_terms=3, low_rank=2, bias=True)
    weight = layer.effective_weight().detach().clone()
    down, up = torch.randn(4, 48), torch.randn(32, 4)
    grow_by_low_rank(layer, down, up)
    assert layer.low_rank == 2 + 2 and layer.S1.shape == (48, 12)
    torch.testing.assert_close(layer.effective_weight(), weight + up @ down, rtol=1e-5, atol=1e-5)
    cut_to_low_rank(layer, 2)
    torch.testing.assert_close(layer.effective_weight(), weight, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="down must be"):
        grow_by_low_rank(layer, torch.randn(4, 32), up)


def test_sketched_lora_needs_a_lora_config():
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        sketched_lora({"r": 8})
