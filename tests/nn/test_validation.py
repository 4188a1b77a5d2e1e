"""panther_lite.nn.validation: every check names the argument and what was expected."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from panther_lite.nn import validation
from panther_lite.nn.validation import (
    check_choice,
    check_finite,
    check_fraction,
    check_gram,
    check_int,
    check_int_tuple,
    check_materialized,
    check_nonnegative_int,
    check_positive_int,
    check_tensor,
)


@given(st.integers(1, 10**6))
def test_positive_ints_pass_through_any_integer_type(value):
    assert check_positive_int("n", value) == value
    assert check_positive_int("n", np.int64(value)) == value


@pytest.mark.parametrize("bad", [0, -3, 1.0, 2.5, "3", None, True, False])
def test_positive_int_rejects_everything_else_naming_the_argument(bad):
    with pytest.raises(ValueError, match=rf"num_terms must be an integer >= 1, got {bad!r}"):
        check_positive_int("num_terms", bad)


def test_int_ranges_and_nonnegative():
    assert check_nonnegative_int("pad", 0) == 0
    assert check_int("x", -5) == -5
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 9\], got 10"):
        check_int("seed", 10, 0, 9)
    with pytest.raises(ValueError, match=r"x must be an integer <= 3"):
        check_int("x", 4, maximum=3)
    with pytest.raises(ValueError, match=r"pad must be an integer >= 0"):
        check_nonnegative_int("pad", -1)


def test_fraction_choice_and_tuples():
    assert check_fraction("param_ratio", 1) == 1.0
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"param_ratio must be a number in \(0, 1\] \(stored fraction\)"):
            check_fraction("param_ratio", bad, "stored fraction")
    assert check_choice("init", "svd", ("sketch", "svd")) == "svd"
    with pytest.raises(ValueError, match=r"init must be one of \('sketch', 'svd'\), got 'random'"):
        check_choice("init", "random", ("sketch", "svd"))
    assert check_int_tuple("kernel_size", 3, 3) == (3, 3, 3)
    assert check_int_tuple("padding", [0, 2], 2, minimum=0) == (0, 2)
    for bad in ((1, 2, 3), (1, 0), 0, "3", (1.5, 2)):
        with pytest.raises(ValueError, match=r"stride must be a positive int or a tuple of 2 such ints"):
            check_int_tuple("stride", bad, 2)


def test_tensor_shape_and_meta_checks():
    with pytest.raises(TypeError, match="W_init must be a Tensor, got list"):
        check_tensor("W_init", [[1.0]])
    with pytest.raises(ValueError, match=r"W_init must have shape \(out, in\) = \(2, 3\), got \(3, 2\)"):
        check_tensor("W_init", torch.zeros(3, 2), (2, 3), "(out, in)")
    with pytest.raises(ValueError, match="layer 'fc': weight is on the meta device"):
        check_materialized("weight", torch.empty(2, device="meta"), layer="fc")


def test_finite_check_counts_nan_and_inf_and_names_the_layer():
    check_finite("weight", torch.ones(4))
    check_finite("ids", torch.arange(3))  # integer tensors cannot be non-finite
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    with pytest.raises(ValueError, match=r"layer 'enc.0': weight contains non-finite values \(1 NaN, 2 Inf of 4"):
        check_finite("weight", bad, layer="enc.0")


def test_gram_checks_shape_values_symmetry_and_definiteness():
    x = torch.randn(50, 6, dtype=torch.float64)
    gram = x.t() @ x
    check_gram(gram, 6)
    check_gram(torch.zeros(6, 6), 6)  # all-zero calibration inputs: PSD
    check_gram(gram.float(), 6)
    with pytest.raises(TypeError, match="gram must be a Tensor"):
        check_gram(gram.tolist(), 6)
    with pytest.raises(ValueError, match=r"gram must have shape \(in_features, in_features\) = \(5, 5\)"):
        check_gram(gram, 5, "in_features")
    with pytest.raises(ValueError, match="layer 'fc': gram is not positive semi-definite"):
        check_gram(-gram, 6, layer="fc")
    skew = gram.clone()
    skew[0, 5] += 1.0
    with pytest.raises(ValueError, match="gram is not symmetric"):
        check_gram(skew, 6)
    gram[1, 1] = float("inf")
    with pytest.raises(ValueError, match="gram contains non-finite values"):
        check_gram(gram, 6)


def test_gram_checks_span_blocks_and_leave_the_gram_unchanged(monkeypatch):
    """The symmetry check runs a pair of blocks at a time and the definiteness check factorises
    a copy in place: an asymmetry in an off-diagonal block is found, and the Gram is untouched."""
    blockwise = validation._largest_asymmetry
    monkeypatch.setattr(validation, "_largest_asymmetry", lambda matrix: blockwise(matrix, block=4))
    x = torch.randn(40, 10, dtype=torch.float64)
    gram = x.t() @ x
    before = gram.clone()
    check_gram(gram, 10)
    assert torch.equal(gram, before)
    skew = gram.clone()
    skew[9, 2] += 1.0  # rows 8-9 against columns 0-3: a block off the diagonal
    with pytest.raises(ValueError, match="gram is not symmetric"):
        check_gram(skew, 10)
    with pytest.raises(ValueError, match="not positive semi-definite"):
        check_gram(gram - 2 * torch.eye(10, dtype=torch.float64) * gram.diagonal().max(), 10)


@pytest.mark.parametrize("num_terms, low_rank", [(2**40, 2**40), (2**62, 1), (1, 2**62)])
def test_sketch_sizes_beyond_a_tensor_are_named(num_terms, low_rank):
    from panther_lite.nn import SKConv2d, SKLinear

    builds = (lambda: SKLinear(64, 64, num_terms, low_rank), lambda: SKConv2d(4, 4, 3, num_terms=num_terms, low_rank=low_rank))
    for build in builds:
        with pytest.raises(ValueError, match="num_terms=.*low_rank=.*more than a tensor can hold"):
            build()
