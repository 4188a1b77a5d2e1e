"""The no-grad bfloat16 route on CPU runs the cached factors prepacked for oneDNN: outputs equal the
plain PyTorch reference and the unpacked route, float32 and autograd keep plain GEMMs, an in-place
update is seen, and mismatched operands keep their clear errors."""
from __future__ import annotations

import pytest
import torch

from panther_lite.nn import SKLinear, clear_factor_cache, factor_cache, onednn_packing, sketched_linear

pytestmark = pytest.mark.skipif(not onednn_packing._SUPPORTED, reason="no oneDNN bfloat16 inner products on this CPU")


def _layer(bias: bool = True, dtype=torch.bfloat16) -> SKLinear:
    torch.manual_seed(0)
    return SKLinear(96, 80, num_terms=2, low_rank=6, bias=bias, init="svd", W_init=torch.randn(80, 96), dtype=dtype)


def _assert_matches_reference(out: torch.Tensor, layer: SKLinear, x: torch.Tensor) -> None:
    """``out`` against ``x @ W_eff.T + b`` in float32 at bfloat16 tolerances: two products,
    each rounded to bfloat16 (8 bits of mantissa), relative to the output's magnitude."""
    reference = x.float() @ layer.effective_weight().float().t()
    reference = reference if layer.bias is None else reference + layer.bias.float()
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


def _cached_is_packed() -> bool:
    (entry,) = factor_cache._CACHE.values()
    return entry.left.is_mkldnn and entry.right.is_mkldnn


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_no_grad_products_are_packed_and_equal_the_reference(rows, bias, monkeypatch):
    layer = _layer(bias)
    x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
    clear_factor_cache()
    with torch.no_grad():
        packed = layer(x)
        assert _cached_is_packed()
        monkeypatch.setattr(onednn_packing, "_SUPPORTED", False)
        clear_factor_cache()
        plain = layer(x)
    assert packed.shape == (2, rows, 80) and packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed, plain)
    _assert_matches_reference(packed, layer, x)


def test_float32_and_autograd_keep_plain_gemms():
    layer, x = _layer(dtype=torch.float32), torch.randn(4, 96)
    clear_factor_cache()
    with torch.no_grad():
        layer(x)
    assert not _cached_is_packed()
    clear_factor_cache()
    layer_bf16 = _layer()
    out = layer_bf16(x.bfloat16())  # S1 requires grad: the custom op, nothing cached
    out.sum().backward()
    assert not factor_cache._CACHE and layer_bf16.S1.grad is not None


def test_an_in_place_update_reaches_the_packed_factors():
    layer, x = _layer(), torch.randn(1, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
        layer.S2.mul_(2)
        after = layer(x)
    assert not torch.equal(before, after)
    _assert_matches_reference(after, layer, x)


def test_mismatched_operands_keep_their_clear_errors():
    layer = _layer()
    with torch.no_grad(), pytest.raises(TypeError, match="input has torch.float32"):
        layer(torch.randn(1, 96))
    with torch.no_grad(), pytest.raises(TypeError, match="bias has dtype torch.float32"):
        sketched_linear(torch.randn(1, 96, dtype=torch.bfloat16), layer.S1, layer.U1, layer.U2, layer.S2,
                        layer.bias.float(), layer.scale)
