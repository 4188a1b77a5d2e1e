"""Sketching operators: apply agrees with the dense form, seeding, the JL moments, arguments."""
from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from panther_lite import sketch
from panther_lite.sketch import (
    CountSketch,
    GaussianSketch,
    SignSketch,
    SJLTSketch,
    SRHTSketch,
    fwht,
    hadamard_entries,
    make_sketch,
    next_power_of_two,
)
from panther_lite.sketch import operators

KINDS = ("gaussian", "sign", "srht", "countsketch", "sjlt")
CLASSES = {"gaussian": GaussianSketch, "sign": SignSketch, "srht": SRHTSketch,
           "countsketch": CountSketch, "sjlt": SJLTSketch}
F64 = {"rtol": 1e-12, "atol": 1e-12}


def build(kind, m, n, nnz=None, **kwargs):
    extra = {"nnz_per_column": nnz if nnz is not None else min(3, m)} if kind == "sjlt" else {}
    return make_sketch(kind, m, n, **extra, **kwargs)


@st.composite
def operator_cases(draw, kinds=KINDS):
    """(kind, m, n, nnz, leading shape) with m valid for the kind (SRHT: m <= padded n)."""
    kind = draw(st.sampled_from(kinds))
    n = draw(st.integers(1, 70))
    m_max = next_power_of_two(n) if kind == "srht" else 40
    m = draw(st.integers(1, m_max))
    nnz = draw(st.integers(1, m))
    lead = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
    return kind, m, n, nnz, lead


@pytest.fixture(params=["csr", "index_add"])
def sjlt_path(request, monkeypatch):
    """Run a test through each SJLT apply implementation (the CPU CSR product and the scatter-add)."""
    if request.param == "index_add":
        monkeypatch.setattr(operators, "_CPU_SPARSE_MATMUL_DTYPES", ())
    return request.param


# --- Walsh–Hadamard transform -------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(log_size=st.integers(0, 8), lead=st.lists(st.integers(0, 3), max_size=2), seed=st.integers(0, 2**16))
def test_fwht_is_product_with_sylvester_hadamard_matrix(log_size, lead, seed):
    size = 2**log_size
    x = torch.randn(*lead, size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    hadamard = torch.from_numpy(scipy.linalg.hadamard(size).astype(np.float64))
    torch.testing.assert_close(fwht(x), x @ hadamard, rtol=1e-12, atol=1e-11)
    torch.testing.assert_close(fwht(fwht(x, normalized=True), normalized=True), x, **F64)


def test_fwht_rejects_non_power_of_two_and_scalars():
    with pytest.raises(ValueError, match="power of two, got 12"):
        fwht(torch.zeros(3, 12))
    with pytest.raises(ValueError, match="at least one dimension"):
        fwht(torch.tensor(1.0))
    with pytest.raises(TypeError, match="Tensor"):
        fwht([1.0, 2.0])


def test_hadamard_entries_match_scipy():
    size = 64
    rows, cols = torch.tensor([0, 5, 63, 17]), torch.arange(0, size, 3)
    expected = torch.from_numpy(scipy.linalg.hadamard(size))[rows][:, cols]
    assert torch.equal(hadamard_entries(rows, cols, size), expected)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_entries(rows, cols, 48)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 2, 4, 4, 8, 1024, 1024, 2048]
    with pytest.raises(ValueError, match="integer >= 1"):
        next_power_of_two(0)


# --- apply == dense form ------------------------------------------------------------------------

# sjlt_path patches once per test, which is what every generated input should see.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=operator_cases(), seed=st.integers(0, 2**16))
def test_apply_equals_product_with_dense_form(sjlt_path, case, seed):
    kind, m, n, nnz, lead = case
    S = build(kind, m, n, nnz, seed=seed, dtype=torch.float64)
    x = torch.randn(*lead, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    dense = S.to_dense()
    assert dense.shape == (m, n) and dense.dtype == torch.float64
    out = S.apply(x)
    assert out.shape == (*lead, m)
    torch.testing.assert_close(out, x @ dense.T, **F64)
    torch.testing.assert_close(S(x), out, rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(case=operator_cases(kinds=("srht",)), seed=st.integers(0, 2**16))
def test_srht_dense_form_is_sampled_signed_hadamard_rows(case, seed):
    _, m, n, _, _ = case
    S = SRHTSketch(m, n, seed=seed, dtype=torch.float64)
    size = next_power_of_two(n)
    hadamard = torch.from_numpy(scipy.linalg.hadamard(size).astype(np.float64))
    expected = hadamard[S.rows][:, :n] * S.signs / math.sqrt(m)
    assert S.padded_n == size and S.rows.unique().numel() == m
    assert torch.equal(S.to_dense(), expected)


@settings(max_examples=30, deadline=None)
@given(case=operator_cases(kinds=("sjlt", "countsketch")), seed=st.integers(0, 2**16))
def test_sparse_sketches_have_s_distinct_nonzeros_per_column(case, seed):
    kind, m, n, nnz, _ = case
    S = build(kind, m, n, nnz, seed=seed, dtype=torch.float64)
    s = 1 if kind == "countsketch" else nnz
    dense = S.to_dense()
    assert torch.equal((dense != 0).sum(dim=0), torch.full((n,), s))
    assert torch.equal(dense[dense != 0].abs(), torch.full((n * s,), 1 / math.sqrt(s), dtype=torch.float64))
    assert torch.equal(S.to_sparse().to_dense(), dense)


def test_sign_sketch_is_sign_matrix_and_gaussian_is_gaussian_matrix():
    assert torch.equal(SignSketch(6, 9, seed=3).to_dense(), sketch.sign_matrix(6, 9, seed=3))
    assert torch.equal(GaussianSketch(6, 9, seed=3).to_dense(), sketch.gaussian_matrix(6, 9, seed=3))


@pytest.mark.parametrize("kind", KINDS)
def test_apply_is_linear(sjlt_path, kind):
    S = build(kind, 12, 37, seed=0, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 5, 37, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(S(2.5 * x - 0.75 * y), 2.5 * S(x) - 0.75 * S(y), **F64)


@pytest.mark.parametrize("kind", KINDS)
def test_apply_gradient_matches_finite_differences(sjlt_path, kind):
    S = build(kind, 5, 11, seed=0, dtype=torch.float64)
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(S.apply, (x,))


# --- seeding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_operator_different_seed_different(kind):
    a, b, c = (build(kind, 8, 20, seed=s).to_dense() for s in (7, 7, 8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("kind", KINDS)
def test_generator_argument_draws_like_the_seed_and_advances(kind):
    gen = torch.Generator().manual_seed(11)
    first, second = build(kind, 8, 20, generator=gen), build(kind, 8, 20, generator=gen)
    assert torch.equal(first.to_dense(), build(kind, 8, 20, seed=11).to_dense())
    assert not torch.equal(first.to_dense(), second.to_dense())
    torch.manual_seed(5)
    from_global = build(kind, 8, 20).to_dense()
    torch.manual_seed(5)
    assert torch.equal(build(kind, 8, 20).to_dense(), from_global)
    with pytest.raises(ValueError, match="either seed or generator"):
        build(kind, 8, 20, seed=1, generator=gen)
    assert torch.equal(build(kind, 8, 20, seed=np.int64(11)).to_dense(), first.to_dense())
    for bad in (1.5, "11", True):
        with pytest.raises(TypeError, match="seed must be an int"):
            build(kind, 8, 20, seed=bad)


@pytest.mark.parametrize("kind", KINDS)
def test_seeds_must_fit_in_64_bits(kind):
    for edge in (-(2**63), 2**64 - 1):
        assert torch.equal(build(kind, 4, 6, seed=edge).to_dense(), build(kind, 4, 6, seed=edge).to_dense())
    for bad in (2**64, -(2**63) - 1, 10**30):
        with pytest.raises(ValueError, match=r"seed must fit in 64 bits .*got " + str(bad)):
            build(kind, 4, 6, seed=bad)


# --- statistics (Johnson–Lindenstrauss moments) -------------------------------------------------
# For every kind and j != k, Var[(SᵀS)_jk] <= 1/m, and Var[(SᵀS)_jj] is 2/m (Gaussian) or 0
# (the others: every column has unit norm). For a unit vector x, Var‖Sx‖² <= 2/m for every
# kind (Gaussian: exactly 2/m; sign and SJLT: (2/m)(1 - Σx⁴) at most; SRHT: m rows drawn without
# replacement from N values z_i² with mean 1 and E z⁴ <= 3). Means over R draws therefore have
# standard deviation <= sqrt(2/(mR)); Z_TOL standard deviations bound every entry (a union bound
# over the n² entries leaves a failure probability below 1e-3 for the fixed seeds below).
Z_TOL = 5.0
DRAWS = 400
M, N = 16, 24  # N is not a power of two, so SRHT pads to 32


@pytest.mark.parametrize("kind", KINDS)
def test_mean_of_gram_matrix_is_identity(kind):
    gen = torch.Generator().manual_seed(2024)
    dense = torch.stack([build(kind, M, N, generator=gen, dtype=torch.float64).to_dense() for _ in range(DRAWS)])
    grams = dense.transpose(1, 2) @ dense
    tolerance = Z_TOL * math.sqrt(2 / (M * DRAWS))
    assert (grams.mean(0) - torch.eye(N, dtype=torch.float64)).abs().max() < tolerance
    if kind != "gaussian":
        diagonals = grams.diagonal(dim1=1, dim2=2)
        torch.testing.assert_close(diagonals, torch.ones_like(diagonals), **F64)


@pytest.mark.parametrize("kind", KINDS)
def test_squared_norm_is_preserved_in_expectation_and_concentrates(kind):
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(N, dtype=torch.float64, generator=gen)
    x = x / x.norm()
    norms = torch.stack([build(kind, M, N, generator=gen, dtype=torch.float64)(x).square().sum() for _ in range(DRAWS)])
    sigma = math.sqrt(2 / M)  # upper bound on the standard deviation of ‖Sx‖²
    assert abs(norms.mean().item() - 1) < Z_TOL * sigma / math.sqrt(DRAWS)
    # Chebyshev: at most 1/9 of the draws may fall outside 1 ± 3σ.
    assert ((norms - 1).abs() > 3 * sigma).double().mean().item() <= 1 / 9


# --- dtype, device, conversion -------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_dtype_argument_and_default(kind):
    assert build(kind, 4, 9, seed=0).dtype == torch.get_default_dtype()
    S = build(kind, 4, 9, seed=0, dtype=torch.float64)
    assert S.dtype == torch.float64 and S.to_dense().dtype == torch.float64
    assert S(torch.ones(9, dtype=torch.float64)).dtype == torch.float64
    with pytest.raises(TypeError, match="dtype torch.float64 but the input has dtype torch.float32"):
        S(torch.ones(9))
    with pytest.raises(TypeError, match="floating-point"):
        build(kind, 4, 9, dtype=torch.int64)


@pytest.mark.parametrize("kind", KINDS)
def test_to_converts_values_keeps_indices_and_leaves_original(kind):
    S = build(kind, 4, 9, seed=0, dtype=torch.float64)
    S32 = S.to(dtype=torch.float32)
    assert S.dtype == torch.float64 and S32.dtype == torch.float32
    assert torch.equal(S32.to_dense(), S.to_dense().float())
    x = torch.randn(3, 9)
    torch.testing.assert_close(S32(x), S(x.double()).float(), rtol=1e-6, atol=1e-6)
    for name in S._tensor_names:
        original, converted = getattr(S, name), getattr(S32, name)
        assert converted.dtype == (torch.float32 if original.is_floating_point() else original.dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_device_argument_places_operator(kind):
    S = build(kind, 4, 9, seed=0, device="meta")
    assert S.device.type == "meta" and S.to_dense().device.type == "meta"
    out = S(torch.empty(2, 3, 9, device="meta"))
    assert out.shape == (2, 3, 4) and out.device.type == "meta"
    assert build(kind, 4, 9, seed=0, device="cpu").device == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_and_cuda_operators_from_one_seed_agree(kind):
    cpu = build(kind, 16, 50, seed=3, dtype=torch.float64)
    cuda = build(kind, 16, 50, seed=3, dtype=torch.float64, device="cuda")
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.to_dense().cpu(), cpu.to_dense())
    x = torch.randn(4, 50, dtype=torch.float64)
    torch.testing.assert_close(cuda(x.cuda()).cpu(), cpu(x), **F64)
    torch.testing.assert_close(cpu.to(device="cuda")(x.cuda()).cpu(), cpu(x), **F64)


# --- factory, repr, argument validation ----------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_make_sketch_builds_the_named_class(kind):
    S = build(kind, 4, 9, seed=0)
    assert type(S) is CLASSES[kind] and (S.m, S.n) == (4, 9)
    assert repr(S).startswith(f"{CLASSES[kind].__name__}(m=4, n=9")


def test_make_sketch_forwards_options_and_rejects_unknown_ones():
    assert make_sketch("sjlt", 6, 9, nnz_per_column=4, seed=0).nnz_per_column == 4
    with pytest.raises(TypeError, match="nnz_per_column"):
        make_sketch("sign", 6, 9, nnz_per_column=4)


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(ValueError, match="'gaussian', 'sign', 'srht', 'countsketch', 'sjlt'"):
        make_sketch("hadamard", 4, 9)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m, n", [(0, 5), (5, 0), (-1, 5), (2.0, 5), (True, 5), (5, "7")])
def test_bad_sizes_raise(kind, m, n):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        build(kind, m, n, nnz=1)


@pytest.mark.parametrize("nnz", [0, 7, 2.0, True])
def test_sjlt_nnz_per_column_must_be_between_1_and_m(nnz):
    with pytest.raises(ValueError, match="between 1 and m=6"):
        SJLTSketch(6, 9, nnz_per_column=nnz)


def test_srht_sketch_dimension_is_at_most_padded_input_dimension():
    assert SRHTSketch(16, 9, seed=0).m == 16
    with pytest.raises(ValueError, match="m <= 16"):
        SRHTSketch(17, 9)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise(kind):
    S = build(kind, 4, 9, seed=0)
    with pytest.raises(ValueError, match=r"last dimension is n=9, got shape \(3, 8\)"):
        S(torch.ones(3, 8))
    with pytest.raises(ValueError, match="n=9"):
        S(torch.tensor(1.0))
    with pytest.raises(TypeError, match="expects a Tensor"):
        S.apply([1.0] * 9)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_and_pickle_after_apply_give_the_same_operator(sjlt_path, kind):
    S = build(kind, 4, 9, seed=0)
    x = torch.randn(3, 9)
    expected = S(x)  # the SJLT CPU path caches a sparse CSR matrix here
    for copied in (copy.deepcopy(S), pickle.loads(pickle.dumps(S))):
        assert torch.equal(copied.to_dense(), S.to_dense())
        torch.testing.assert_close(copied(x), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_inputs_are_rejected_with_the_fix(kind, layout):
    S = build(kind, 4, 6, seed=0, dtype=torch.float64)
    dense = torch.randn(3, 6, dtype=torch.float64)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(TypeError, match=r"dense \(strided\) tensor, got layout torch.sparse_.*x.to_dense\(\)"):
        S(sparse)
