"""Tensor-core-aligned rank selection and parameter accounting."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import SKLinear, align_rank, dense_size, select_config, sketch_size, tensor_core_multiple


@pytest.mark.parametrize(
    "dtype,multiple",
    [(torch.float16, 8), (torch.bfloat16, 8), (torch.float32, 4), (torch.float64, 1), (torch.int8, 16)],
)
def test_tensor_core_multiple_per_dtype(dtype, multiple):
    assert tensor_core_multiple(dtype) == multiple


def test_float8_wants_16():
    float8 = getattr(torch, "float8_e4m3fn", None)
    if float8 is None:
        pytest.skip("no float8 dtype in this torch")
    assert tensor_core_multiple(float8) == 16


def test_unknown_dtype_raises():
    with pytest.raises(ValueError, match="dtype"):
        tensor_core_multiple(torch.complex64)


@pytest.mark.parametrize("rank,multiple,expected", [(70, 8, 64), (64, 8, 64), (7, 8, 7), (17, 16, 16), (5, 1, 5)])
def test_align_rank_rounds_down_unless_that_gives_zero(rank, multiple, expected):
    assert align_rank(rank, multiple) == expected


def test_align_rank_rejects_nonpositive():
    with pytest.raises(ValueError):
        align_rank(0, 8)
    with pytest.raises(ValueError):
        align_rank(8, 0)


def test_sketch_size_matches_a_real_layer():
    layer = SKLinear(96, 40, 3, 4, bias=False)
    size = sketch_size(96, 40, 3, 4, bias=False)
    assert size.trainable == sum(p.numel() for p in layer.parameters())
    assert size.stored == size.trainable + sum(b.numel() for b in layer.buffers())
    assert dense_size(96, 40, bias=False) == 96 * 40


@settings(max_examples=200, deadline=None)
@given(
    fan_in=st.integers(1, 8192),
    fan_out=st.integers(1, 8192),
    ratio=st.floats(0.001, 2.0),
    num_terms=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    bias=st.booleans(),
)
def test_selected_config_never_exceeds_budget_and_is_aligned(fan_in, fan_out, ratio, num_terms, dtype, bias):
    config = select_config(fan_in, fan_out, ratio, num_terms=num_terms, dtype=dtype, bias=bias)
    budget = ratio * dense_size(fan_in, fan_out, bias)
    if config is None:
        assert sketch_size(fan_in, fan_out, num_terms, 1, bias).stored > budget
        return
    L, k = config
    assert L == num_terms and k >= 1
    assert sketch_size(fan_in, fan_out, L, k, bias).stored <= budget
    multiple = tensor_core_multiple(dtype)
    largest = k
    while sketch_size(fan_in, fan_out, L, largest + 1, bias).stored <= budget:
        largest += 1
    assert k == (largest if largest < multiple else largest - largest % multiple)


def test_select_config_example_and_errors():
    # 4096x4096 at 1/8 of the dense size: Lk <= 4096*4096/8 / (2*8192) = 128.
    assert select_config(4096, 4096, 0.125, dtype=torch.bfloat16, bias=False) == (1, 128)
    assert select_config(4096, 4096, 0.125, num_terms=3, dtype=torch.bfloat16, bias=False) == (3, 40)
    assert select_config(4, 4, 0.01) is None
    with pytest.raises(ValueError, match="param_ratio"):
        select_config(8, 8, 0)
    with pytest.raises(ValueError, match="num_terms"):
        select_config(8, 8, 0.5, num_terms=0)
