"""Fixtures of the layer tests: ``moe``, tiny transformers experts modules and routings
shared by the SKExperts tests."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

HIDDEN, INTER, EXPERTS, TOP_K = 16, 12, 4, 2
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    return MixtralExperts, config


def _qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    return Qwen2MoeExperts, Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts, Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS)


def _olmoe():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    return OlmoeExperts, OlmoeConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS)


def _gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts, GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)


MODELS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe, "gpt_oss": _gpt_oss}


def dense_experts(model: str, dtype=torch.float32, seed: int = 0, implementation: str = "eager"):
    """A tiny experts module of ``model`` with seeded N(0, 0.2²) weights (biases too) and its
    config's experts implementation set."""
    cls, config = MODELS[model]()
    config._experts_implementation = implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experts = cls(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return experts.to(dtype)


def routing(tokens: int = 9, seed: int = 1, dtype=torch.float32, skip_expert=None):
    """``(hidden_states, top_k_index, top_k_weights)`` with distinct top-k experts per token;
    ``skip_expert`` receives no token."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, generator=generator)
    if skip_expert is not None:
        logits[:, skip_expert] = -torch.inf
    weights, index = torch.topk(logits.softmax(-1), TOP_K)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    return hidden.to(dtype), index, weights.to(dtype)


def full_rank_terms():
    """``(num_terms, low_rank)`` with ``2Lk = HIDDEN >= min(in, out)`` of both projections: exact."""
    return 2, HIDDEN // 4


@pytest.fixture
def moe():
    """The helpers and sizes above: ``moe.dense_experts(model)``, ``moe.routing()``, ..."""
    pytest.importorskip("transformers")
    return SimpleNamespace(
        HIDDEN=HIDDEN, INTER=INTER, EXPERTS=EXPERTS, TOP_K=TOP_K, IMPLEMENTATIONS=IMPLEMENTATIONS, MODELS=MODELS,
        dense_experts=dense_experts, routing=routing, full_rank_terms=full_rank_terms,
    )
