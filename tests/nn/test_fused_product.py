"""The fused stacked product (one Triton kernel) computes what the two GEMMs of the stacked schedule
compute: under Triton's interpreter on the CPU (CI) and on a CUDA device where one is present."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from panther_lite.nn.functional import stacked_rows_forward  # noqa: E402
from panther_lite.nn.fused_product import LARGEST_RANK, fused_available, fused_stacked_product  # noqa: E402

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(rows, inputs, rank, outputs, dtype, bias, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=generator)
    left = torch.randn(inputs, rank, generator=generator) / inputs**0.5
    right = torch.randn(rank, outputs, generator=generator) / rank**0.5
    b = torch.randn(outputs, generator=generator) if bias else None
    return [None if t is None else t.to(device, dtype) for t in (x, left, right, b)]


def _check(x, left, right, bias, scale=0.25):
    got = fused_stacked_product(x, left, right, bias, scale)
    expected, _ = stacked_rows_forward(x, left, right, bias, scale)  # the two GEMMs, same dtype
    assert got.dtype == x.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOLERANCE[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, inputs, rank, outputs, bias", [
    (50, 70, 24, 90, True),     # nothing a multiple of a block; a rank padded to 32
    (33, 64, LARGEST_RANK, 130, False),
    (1, 48, 8, 40, True),       # one row: a decode step
    (0, 48, 8, 40, True),       # no rows
])
def test_the_fused_product_is_the_two_gemms(interpreted, dtype, rows, inputs, rank, outputs, bias):
    _check(*_operands(rows, inputs, rank, outputs, dtype, bias))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 70), inputs=st.integers(1, 80), rank=st.integers(1, 64), outputs=st.integers(1, 80),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_any_shape_matches_in_float32(rows, inputs, rank, outputs, bias, seed):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        _check(*_operands(rows, inputs, rank, outputs, torch.float32, bias, seed=seed))


def test_strided_operands_are_read_through_their_strides(interpreted):
    x, left, right, bias = _operands(40, 56, 16, 72, torch.float32, True)
    _check(x.t().contiguous().t(), left.t().contiguous().t(), right[:, ::1].t().contiguous().t(), bias)


@pytest.mark.parametrize("shapes, match", [
    (((4, 8), (8, LARGEST_RANK + 1), (LARGEST_RANK + 1, 8)), "R <= 256"),
    (((4, 8), (9, 4), (4, 8)), "left"),
    (((4, 8), (8, 4), (5, 8)), "right"),
    (((2, 4, 8), (8, 4), (4, 8)), "x \\(rows, in\\)"),
])
def test_shapes_that_do_not_chain_are_named(interpreted, shapes, match):
    operands = [torch.randn(*shape) for shape in shapes]
    with pytest.raises(ValueError, match=match):
        fused_stacked_product(*operands, None, 1.0)


def test_on_the_cpu_without_the_interpreter_it_says_what_it_needs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 8)
    assert not fused_available(x)
    with pytest.raises(RuntimeError, match="needs Triton and a CUDA tensor"):
        fused_stacked_product(x, torch.randn(8, 4), torch.randn(4, 8), None, 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_on_the_gpu_the_fused_product_is_the_two_gemms(dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    _check(*_operands(4096, 1024, 128, 2048, dtype, True, device="cuda"))
