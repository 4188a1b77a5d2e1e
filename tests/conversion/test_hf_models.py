"""Hugging Face models as users bring them: tiny random-init GPT-2, LLaMA (tied and untied
head), BERT, T5, ALBERT and a PEFT LoRA model go through convert, forward, a train step,
bf16, save_pretrained/from_pretrained and densify; each family converts its projections and
keeps dense exactly the layers it must (tied heads, PEFT adapters and base layers)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion.saving.loading import from_pretrained  # noqa: E402
from panther_lite.conversion.saving.pretrained import save_pretrained  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

# PEFT calls a transformers method that transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

VOCAB, HIDDEN, FFN, HEADS, SEQ = 64, 32, 64, 4, 8
# L=1, k=2 stores 2·2·(32+64) values per layer, well under the 32·64 of a dense one
SIZE = dict(num_terms=1, low_rank=2)
_LORA_PREFIX = "base_model.model.model.layers.0.self_attn."


def _llama(tie: bool) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _albert() -> nn.Module:
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=SEQ,
    )
    return transformers.AlbertForMaskedLM(config)


def _lora_llama() -> nn.Module:
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(_llama(tie=False), lora)


@dataclass(frozen=True)
class Family:
    """One model family: how to build it, and which of its layers must stay dense."""

    build: Callable[[], nn.Module]
    stays_dense: FrozenSet[str]
    load_with: Callable = None  # the class (or factory) given to from_pretrained
    extra_inputs: Dict[str, bool] = field(default_factory=dict)
    frozen_base: bool = False  # PEFT freezes every layer but the adapters


FAMILIES = {
    "gpt2": Family(_gpt2, frozenset({"lm_head"}), transformers.GPT2LMHeadModel),
    "llama-tied": Family(lambda: _llama(tie=True), frozenset({"lm_head"}), transformers.AutoModelForCausalLM),
    "llama-untied": Family(lambda: _llama(tie=False), frozenset(), transformers.LlamaForCausalLM),
    "bert": Family(_bert, frozenset({"cls.predictions.decoder"}), transformers.BertForMaskedLM),
    "t5": Family(_t5, frozenset({"lm_head"}), transformers.T5ForConditionalGeneration, {"decoder_input_ids": True}),
    "albert": Family(_albert, frozenset({"predictions.decoder"}), transformers.AlbertForMaskedLM),
    "peft-lora": Family(
        _lora_llama,
        frozenset(
            _LORA_PREFIX + f"{proj}.{part}"
            for proj in ("q_proj", "v_proj")
            for part in ("base_layer", "lora_A.default", "lora_B.default")
        ),
        _lora_llama,
        frozen_base=True,
    ),
}


def _inputs(family: Family) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    inputs = dict(input_ids=ids)
    if family.extra_inputs.get("decoder_input_ids"):
        inputs["decoder_input_ids"] = ids[:, : SEQ // 2]
    return inputs


def _logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).logits


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def converted(request):
    """(family, converted model in eval mode, its report, inputs, dense logits)."""
    family = FAMILIES[request.param]
    torch.manual_seed(0)
    model = family.build().eval()
    inputs = _inputs(family)
    with torch.no_grad():
        dense = _logits(model, inputs)
    report = panther_lite.convert(model, example_inputs=inputs, **SIZE)
    return family, model, report, inputs, dense


def test_converts_projections_and_keeps_the_rest_dense_with_a_reason(converted):
    family, model, report, _, _ = converted
    status = dict(zip(report["name"], report["status"]))
    reasons = dict(zip(report["name"], report["reason"]))
    kept = {name for name, state in status.items() if state != "converted"}
    assert kept == family.stays_dense, report[["name", "status", "reason"]].to_string()
    assert all(reasons[name] for name in kept)
    assert sum(isinstance(m, SKLinear) for m in model.modules()) == len(status) - len(kept) > 0


def test_forward_and_train_step(converted):
    family, model, _, inputs, dense = converted
    model.train()
    out = _logits(model, inputs)
    assert out.shape == dense.shape and torch.isfinite(out).all()
    out.float().square().mean().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    before = [p.detach().clone() for p in trainable]
    torch.optim.SGD(trainable, lr=0.1).step()
    assert any(not torch.equal(p, b) for p, b in zip(trainable, before))
    # the sketched factors keep the trainability of the layers they replace (PEFT froze those)
    factors = [m.S1 for m in model.modules() if isinstance(m, SKLinear)]
    assert all(f.requires_grad is not family.frozen_base for f in factors)


def test_bf16_forward(converted):
    _, model, _, inputs, dense = converted
    model.to(torch.bfloat16)
    with torch.no_grad():
        out = _logits(model, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_save_and_load_gives_identical_outputs(converted, tmp_path):
    family, model, _, inputs, _ = converted
    with torch.no_grad():
        expected = _logits(model, inputs)
    save_pretrained(model, tmp_path / "saved")
    loaded = from_pretrained(family.load_with, tmp_path / "saved").eval()
    assert type(loaded) is type(model)
    assert sorted(n for n, m in loaded.named_modules() if isinstance(m, SKLinear)) == sorted(
        n for n, m in model.named_modules() if isinstance(m, SKLinear)
    )
    with torch.no_grad():
        assert torch.equal(_logits(loaded, inputs), expected)


def test_densify_keeps_the_function(converted):
    _, model, _, inputs, _ = converted
    with torch.no_grad():
        expected = _logits(model, inputs)
        panther_lite.densify(model)
        assert not any(isinstance(m, SKLinear) for m in model.modules())
        torch.testing.assert_close(_logits(model, inputs), expected, rtol=1e-4, atol=1e-5)


def test_saved_config_records_the_conversion(tmp_path):
    torch.manual_seed(0)
    model = _llama(tie=False)
    panther_lite.convert(model, **SIZE)
    save_pretrained(model, tmp_path)
    recorded = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert recorded == {"quant_method": "panther_lite", "conversion": panther_lite.conversion_config(model)}
    assert not hasattr(model.config, "quantization_config")  # the live config is left as it was


def test_transformers_save_needs_its_class(tmp_path):
    model = _llama(tie=False)
    panther_lite.convert(model, **SIZE)
    save_pretrained(model, tmp_path)
    with pytest.raises(TypeError, match="pass its class"):
        from_pretrained(lambda: _llama(tie=False), tmp_path)
    with pytest.raises(ValueError, match="holds a LlamaForCausalLM"):
        from_pretrained(transformers.AutoModel, tmp_path)


def test_load_passes_dtype_to_transformers(tmp_path):
    torch.manual_seed(0)
    model = _llama(tie=False).eval()
    panther_lite.convert(model, **SIZE)
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(transformers.LlamaForCausalLM, tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    inputs = _inputs(FAMILIES["llama-untied"])
    with torch.no_grad():
        # not bitwise: .to() also casts the rotary frequencies, which transformers keeps in float32
        torch.testing.assert_close(
            _logits(loaded, inputs), _logits(model.to(torch.bfloat16), inputs), rtol=1.6e-2, atol=1e-3
        )
