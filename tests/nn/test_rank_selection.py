"""Tensor-core-aligned rank selection and parameter accounting."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import SKLinear, align_rank, dense_size, select_config, sketch_size, tensor_core_multiple
from panther_lite.nn.rank_selection import largest_rank, resolve_rank_multiple


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


def _largest_fitting(fan_in, fan_out, num_terms, budget, bias):
    rank = 0
    while sketch_size(fan_in, fan_out, num_terms, rank + 1, bias).stored <= budget:
        rank += 1
    return rank


@settings(max_examples=200, deadline=None)
@given(
    fan_in=st.integers(1, 8192),
    fan_out=st.integers(1, 8192),
    ratio=st.floats(0.001, 2.0),
    num_terms=st.integers(1, 8),
    multiple=st.sampled_from([1, 4, 8, 16]),
    bias=st.booleans(),
)
def test_selected_config_stays_within_budget_fills_it_and_aligns_when_cheap(fan_in, fan_out, ratio, num_terms, multiple, bias):
    config = select_config(fan_in, fan_out, ratio, num_terms=num_terms, multiple=multiple, bias=bias)
    budget = ratio * dense_size(fan_in, fan_out, bias)
    largest = _largest_fitting(fan_in, fan_out, num_terms, budget, bias)
    if config is None:
        assert largest == 0
        return
    L, k = config
    assert L == num_terms and 1 <= k <= largest
    stored = sketch_size(fan_in, fan_out, L, k, bias).stored
    assert stored <= budget
    if sketch_size(fan_in, fan_out, L, largest, bias).stored >= 0.9 * budget:
        assert stored >= 0.9 * budget  # a configuration filling 90% exists, so the choice fills 90%
    aligned = largest - largest % multiple
    if aligned >= 1 and sketch_size(fan_in, fan_out, L, aligned, bias).stored >= 0.9 * budget:
        assert k == aligned
    else:
        assert k == largest


def test_alignment_never_wastes_more_than_a_tenth_of_the_budget():
    # 64 -> 256 at 25%: rank 6 fits (stores 4,096 of 4,160); rank 4 would leave a third unused.
    assert select_config(64, 256, 0.25, multiple=4) == (1, 6)
    assert select_config(256, 256, 0.25, multiple=8) == (1, 15)
    assert select_config(4096, 4096, 0.25, multiple=8, bias=False) == (1, 256)
    assert select_config(4096, 4096, 0.24, multiple=8, bias=False) == (1, 240)  # 245 fits, 240 fills 98%
    assert select_config(4096, 4096, 0.125, multiple=8, bias=False) == (1, 128)


def test_dtype_gives_the_default_multiple_and_no_dtype_means_no_rounding():
    assert select_config(4096, 4096, 0.125, num_terms=3, dtype=torch.bfloat16, bias=False) == (3, 40)
    assert select_config(4096, 4096, 0.125, num_terms=3, bias=False) == (3, 42)
    assert select_config(256, 256, 0.25, dtype=torch.float32) == (1, 15)  # 12 would fill 76%


def test_select_config_errors():
    assert select_config(4, 4, 0.01) is None
    with pytest.raises(ValueError, match="param_ratio"):
        select_config(8, 8, 0)
    with pytest.raises(ValueError, match="num_terms"):
        select_config(8, 8, 0.5, num_terms=0)
    with pytest.raises(ValueError, match="multiple"):
        select_config(8, 8, 0.5, multiple=0)


def test_largest_rank_is_the_largest_that_fits():
    assert largest_rank(256, 256, 0.25 * dense_size(256, 256)) == 15
    assert largest_rank(4, 4, 1.0) == 0


def test_rank_multiple_follows_tensor_cores():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_rank_multiple("auto", cpu, torch.float16) == 1
    assert resolve_rank_multiple("auto", cuda, torch.bfloat16) == 8
    assert resolve_rank_multiple("auto", cuda, torch.float64) == 1
    assert resolve_rank_multiple(None, cuda, torch.float16) == 1
    assert resolve_rank_multiple(16, cpu, torch.float32) == 16
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert resolve_rank_multiple("auto", cuda, torch.float32) == 4
        torch.backends.cuda.matmul.allow_tf32 = False
        assert resolve_rank_multiple("auto", cuda, torch.float32) == 1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    for bad in (0, "yes", 2.0, True):
        with pytest.raises(ValueError, match="align"):
            resolve_rank_multiple(bad, cpu, torch.float32)
