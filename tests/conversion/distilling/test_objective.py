"""The KL of a cached top-k teacher distribution (objective.top_k_log_probs, objective.top_k_kl)
against plain PyTorch references at float64: the k kept tokens plus one tail bucket, equal to
the full KL when k is the whole vocabulary (values and gradients), exact tails however small,
and a tail of no mass that adds nothing and keeps the gradient finite."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from panther_lite.conversion.distilling.objective import at_real_tokens, softened_kl, top_k_kl, top_k_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS, VOCAB = 12, 50


def _logits(seed, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(ROWS, VOCAB, generator=generator, dtype=torch.float64)


def _bucketed_kl(student, teacher, k, temperature):
    """T² · mean over rows of KL over the k most likely teacher tokens and one bucket for the rest
    (the sum of the others' probabilities), from the full softmaxes."""
    p, q = F.softmax(teacher / temperature, -1), F.softmax(student / temperature, -1)
    index = p.topk(k, -1).indices
    p_b = torch.cat([p.gather(-1, index), p.scatter(-1, index, 0.0).sum(-1, keepdim=True)], -1)
    q_b = torch.cat([q.gather(-1, index), q.scatter(-1, index, 0.0).sum(-1, keepdim=True)], -1)
    return (p_b * (p_b.log() - q_b.log())).sum(-1).mean() * temperature**2


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_with_the_whole_vocabulary_it_is_the_full_kl_in_value_and_gradient(temperature):
    teacher = _logits(0)
    student = _logits(1).requires_grad_()
    full = softened_kl(student, teacher, temperature)
    (expected,) = torch.autograd.grad(full, student)
    kept = top_k_log_probs(teacher, VOCAB, temperature)
    assert kept.tail is None and kept.indices.dtype == torch.int32
    cached = top_k_kl(student, kept, temperature)
    (gradient,) = torch.autograd.grad(cached, student)
    assert float(cached.detach()) == pytest.approx(float(full.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(gradient, expected, rtol=1e-10, atol=1e-12)
    k_above = top_k_kl(student, top_k_log_probs(teacher, 10 * VOCAB, temperature), temperature)
    assert float(k_above) == pytest.approx(float(full), rel=1e-10)


@pytest.mark.parametrize("k, temperature", [(1, 1.0), (5, 1.0), (16, 2.0), (VOCAB - 1, 0.7)])
def test_top_k_is_the_kl_over_k_plus_one_buckets(k, temperature):
    teacher, student = _logits(2), _logits(3)
    kept = top_k_log_probs(teacher, k, temperature)
    reference = F.log_softmax(teacher / temperature, -1).topk(k, -1)
    torch.testing.assert_close(kept.log_probs, reference.values, rtol=0, atol=0)
    assert torch.equal(kept.indices.long(), reference.indices)
    torch.testing.assert_close(kept.tail.exp(), 1 - reference.values.exp().sum(-1), rtol=1e-10, atol=1e-14)
    value = top_k_kl(student, kept, temperature)
    assert float(value) == pytest.approx(float(_bucketed_kl(student, teacher, k, temperature)), rel=1e-10)
    assert float(value) <= float(softened_kl(student, teacher, temperature)) + 1e-12  # buckets merge: KL shrinks


def test_tails_far_below_float_rounding_stay_exact():
    teacher = torch.zeros(2, VOCAB, dtype=torch.float64)
    teacher[:, 0] = 60.0  # the rest holds e^-60 (≈ 1e-26) each: 1 - p_0 rounds to 0
    kept = top_k_log_probs(teacher.float(), 1, 1.0)
    expected = math.log(VOCAB - 1) - 60.0
    torch.testing.assert_close(kept.tail, torch.full((2,), expected), rtol=1e-6, atol=0)
    student = torch.zeros(2, VOCAB, dtype=torch.float64, requires_grad=True)
    value = top_k_kl(student, top_k_log_probs(teacher, 1, 1.0), 1.0)
    assert torch.isfinite(value)
    assert float(value.detach()) == pytest.approx(float(_bucketed_kl(student.detach(), teacher, 1, 1.0)), rel=1e-8)


def test_a_tail_of_no_mass_adds_nothing_and_the_gradient_stays_finite():
    teacher = torch.full((3, VOCAB), -math.inf, dtype=torch.float64)
    teacher[:, :4] = torch.tensor([2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    kept = top_k_log_probs(teacher, 4, 1.0)
    assert torch.equal(kept.tail, torch.full((3,), -math.inf, dtype=torch.float64))
    student = _logits(4)[:3].clone().requires_grad_()
    value = top_k_kl(student, kept, 1.0)
    (gradient,) = torch.autograd.grad(value, student)
    p = F.softmax(teacher, -1)[:, :4]
    q = F.softmax(student.detach(), -1)[:, :4]
    expected = (p * (p.log() - q.log())).sum(-1).mean()  # the student's tail bucket gets no teacher mass
    assert float(value.detach()) == pytest.approx(float(expected), rel=1e-10)
    assert torch.isfinite(gradient).all()


def test_no_rows_give_a_zero_loss_with_a_graph():
    student = torch.zeros(0, VOCAB, requires_grad=True)
    value = top_k_kl(student, top_k_log_probs(torch.zeros(0, VOCAB), 4, 1.0), 1.0)
    assert float(value.detach()) == 0.0 and value.requires_grad


def _mixed_tails(dtype):
    """Student logits whose mass outside the teacher's top 4 ranges from most of it to ~1e-9:
    the rows cross the point where ``1 − Σ_k q`` stops being exact in float32."""
    student = _logits(5, scale=1.0)
    student[:, :4] += torch.linspace(0.0, 30.0, ROWS, dtype=torch.float64).unsqueeze(-1)
    teacher = _logits(6, scale=1.0)
    teacher[:, :4] += 6.0  # the teacher's top 4 are the student's heavy tokens
    return student.to(dtype), top_k_log_probs(teacher, 4, 1.0)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_the_written_out_backward_passes_gradcheck_at_float64(temperature):
    mixed, _ = _mixed_tails(torch.float64)
    tiny_tail = _logits(7)[:2].clone()
    tiny_tail[:, 5] = 60.0  # student rows whose tail is ~1e-24: summed exactly, not as 1 − Σ_k q
    student = torch.cat([mixed, tiny_tail]).requires_grad_()
    teacher = torch.cat([mixed, _logits(8)[:2]])
    kept = top_k_log_probs(teacher, 3, temperature)
    assert torch.autograd.gradcheck(lambda s: top_k_kl(s, kept, temperature), (student,))


@pytest.mark.parametrize("dtype, gradient_tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_logits_match_the_float64_reference_at_every_tail_size(dtype, gradient_tolerance):
    student, kept = _mixed_tails(torch.float64)
    student = student.to(dtype).double()  # the reference sees the same rounded logits
    low = student.to(dtype).requires_grad_()
    value = top_k_kl(low, kept, 1.0)
    (gradient,) = torch.autograd.grad(value, low)
    reference = student.clone().requires_grad_()
    index = kept.indices.long()
    q = F.log_softmax(reference, -1)
    q_tail = q.scatter(-1, index, -math.inf).logsumexp(-1)
    expected = (kept.log_probs.exp() * (kept.log_probs - q.gather(-1, index))).sum(-1)
    expected = (expected + kept.tail.exp() * (kept.tail - q_tail)).mean()
    (expected_gradient,) = torch.autograd.grad(expected, reference)
    assert value.dtype == torch.float32 and gradient.dtype == dtype
    assert float(value) == pytest.approx(float(expected), rel=1e-5)
    atol = float(expected_gradient.abs().max()) * gradient_tolerance
    torch.testing.assert_close(gradient.double(), expected_gradient, rtol=0, atol=atol)


def test_a_batch_of_real_tokens_only_is_compared_in_place_and_a_padded_one_at_its_real_tokens():
    logits = torch.randn(2, 3, VOCAB)
    every = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    rows = at_real_tokens(every, logits)
    assert torch.equal(rows, logits.reshape(6, VOCAB)) and rows.data_ptr() == logits.data_ptr()  # no copy
    padded = dict(every, attention_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert torch.equal(at_real_tokens(padded, logits), logits[[0, 0, 1], [0, 1, 0]])
