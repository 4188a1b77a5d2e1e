"""Fixtures of the mixture-of-experts conversion tests: tiny random-init transformers models
(hidden 32, 2 layers, 4 experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, and Falcon for its
``FalconLinear``), their calibration batches, and block-level size measures."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

VOCAB, HIDDEN, INTER, EXPERTS, TOP_K, LAYERS, HEADS = 64, 32, 64, 4, 2, 2, 4


def _config(name: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=64,
    )
    moe = dict(num_key_value_heads=2, num_experts_per_tok=TOP_K)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, **moe, intermediate_size=INTER, num_local_experts=EXPERTS)
    if name == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, **moe, intermediate_size=INTER, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
            num_experts=EXPERTS,
        )
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe, moe_intermediate_size=INTER, num_experts=EXPERTS, head_dim=8)
    if name == "olmoe":
        return transformers.OlmoeConfig(**common, **moe, intermediate_size=INTER, num_experts=EXPERTS, eos_token_id=1)
    if name == "falcon":
        return transformers.FalconConfig(**common, new_decoder_architecture=False, multi_query=True, bias=False)
    raise KeyError(name)


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny causal LM ``name`` in eval mode, its experts on the ``eager`` implementation
    (transformers' ``grouped_mm`` is slow on the CPU)."""
    import transformers

    config = _config(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if name != "falcon":
        model.set_experts_implementation("eager")
    return model.eval()


def batches(count: int = 4, rows: int = 4, length: int = 16, seed: int = 0):
    """Token batches ``(rows, length)`` for calibration."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, length), generator=generator) for _ in range(count)]


def block_list(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def stored(module: nn.Module) -> int:
    """Entries of the parameters and buffers (U sketches included), each tensor counted once."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() for t in tensors.values())


def block_weights(model: nn.Module) -> int:
    return sum(p.numel() for block in block_list(model) for p in block.parameters())


@pytest.fixture
def moe():
    """The builders above: ``moe.build(name)``, ``moe.batches()``, ``moe.stored(m)``, ..."""
    pytest.importorskip("transformers")
    return SimpleNamespace(
        build=build, batches=batches, block_list=block_list, stored=stored, block_weights=block_weights,
        VOCAB=VOCAB, HIDDEN=HIDDEN, INTER=INTER, EXPERTS=EXPERTS, TOP_K=TOP_K,
    )
