"""The no-grad factor cache serves small layers only: a layer whose four factors take more than
``CACHE_MAX_BYTES`` runs uncached (no second copy of a large model at inference), with the outputs
of the cached route."""
from __future__ import annotations

import torch

from panther_lite.nn import SKLinear, factor_cache, functional


def _factor_bytes(layer: SKLinear) -> int:
    return 2 * (layer.S1.numel() + layer.S2.numel()) * layer.S1.element_size()


def test_only_layers_up_to_the_limit_are_cached_and_both_routes_agree(monkeypatch):
    torch.manual_seed(0)
    layer = SKLinear(64, 48, num_terms=1, low_rank=8, bias=True)
    x = torch.randn(5, 64)
    factor_cache.clear_factor_cache()
    monkeypatch.setattr(functional, "CACHE_MAX_BYTES", _factor_bytes(layer))
    with torch.no_grad():
        cached = layer(x)
    assert len(factor_cache._CACHE) == 1
    factor_cache.clear_factor_cache()
    monkeypatch.setattr(functional, "CACHE_MAX_BYTES", _factor_bytes(layer) - 1)
    with torch.no_grad():
        uncached = layer(x)
    assert not factor_cache._CACHE
    torch.testing.assert_close(uncached, cached)


def test_a_tinyllama_sized_projection_is_not_cached():
    layer = SKLinear(2048, 5632, num_terms=1, low_rank=375, bias=False, dtype=torch.bfloat16)
    assert _factor_bytes(layer) > functional.CACHE_MAX_BYTES
    factor_cache.clear_factor_cache()
    with torch.no_grad():
        layer(torch.randn(1, 2048, dtype=torch.bfloat16))
    assert not factor_cache._CACHE
