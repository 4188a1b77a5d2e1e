"""The metric the gains compare outputs in: next-token KL (Fisher) for logits, squared norm otherwise."""
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutput

from panther_lite.conversion.planning.output_distance import OutputProbe, first_tensor, output_logits, probe_output


def _logits(seed=0, shape=(2, 5, 7)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_kl_distance_is_twice_the_summed_kl_of_the_real_tokens_only():
    z, moved = _logits(0), _logits(1)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected = 2 * F.kl_div(F.log_softmax(moved[mask], -1), F.log_softmax(z[mask], -1), log_target=True, reduction="sum")
    probe = OutputProbe(z, mask, kl=True)
    assert abs(probe.distance(moved) - float(expected)) < 1e-12
    assert probe.reference() == 8.0  # real tokens


def test_kl_distance_ignores_a_shift_of_every_logit_that_the_norm_counts():
    z = _logits(0)
    assert OutputProbe(z, None, kl=True).distance(z + 3.0) < 1e-20
    assert abs(OutputProbe(z, None, kl=False).distance(z + 3.0) - 9.0 * z.numel()) < 1e-9


def test_kl_directions_have_the_softmax_fisher_as_covariance_and_skip_padding():
    row = torch.tensor([2.0, 0.5, -1.0, 0.0], dtype=torch.float64)
    z = row.expand(1, 40000, 4).clone()
    u = OutputProbe(z, None, kl=True).direction(torch.Generator().manual_seed(0))[0]
    p = torch.softmax(row, -1)
    fisher = torch.diag(p) - torch.outer(p, p)
    torch.testing.assert_close(u.T @ u / u.shape[0], fisher, atol=6e-3, rtol=0)
    mask = torch.tensor([[True] * 39999 + [False]])
    padded = OutputProbe(z, mask, kl=True).direction(torch.Generator().manual_seed(0))
    assert padded[0, -1].abs().sum() == 0 and padded[0, 0].abs().sum() > 0


def test_norm_directions_are_the_seeded_gaussian_of_before():
    z = _logits(0).float()
    u = OutputProbe(z, None, kl=False).direction(torch.Generator().manual_seed(0))
    torch.testing.assert_close(u, torch.randn(z.shape, generator=torch.Generator().manual_seed(0)), rtol=0, atol=0)


def test_probe_output_takes_logits_when_present_unless_norm_is_asked():
    logits, hidden = _logits(0), _logits(1)
    output = CausalLMOutput(logits=logits, hidden_states=(hidden,))
    assert output_logits(output) is logits and output_logits(hidden) is None
    assert probe_output(output, None, "auto").kl and probe_output(output, None, "kl").tensor is logits
    assert not probe_output(output, None, "norm").kl
    plain = probe_output((hidden, torch.ones(2, dtype=torch.long)), None, "kl")  # no logits: the norm, first tensor
    assert not plain.kl and plain.tensor is hidden
    assert probe_output({"ids": torch.ones(3, dtype=torch.long)}, None, "auto") is None
    assert first_tensor([torch.ones(2, dtype=torch.long), {"a": hidden}]) is hidden


def test_kl_distance_and_directions_over_many_row_chunks_are_the_whole_batch_formulas():
    from panther_lite.conversion.planning.output_distance import ROW_CHUNK

    z, moved = _logits(0, (3, ROW_CHUNK + 37, 11)), _logits(1, (3, ROW_CHUNK + 37, 11))
    mask = torch.ones(z.shape[:2], dtype=torch.bool)
    mask[1, -50:] = False
    expected = 2 * F.kl_div(F.log_softmax(moved[mask], -1), F.log_softmax(z[mask], -1), log_target=True, reduction="sum")
    probe = OutputProbe(z, mask, kl=True)
    assert abs(probe.distance(moved) - float(expected)) < 1e-9 * float(expected)
    u = probe.direction(torch.Generator().manual_seed(0))
    hit = torch.softmax(z, -1) - u  # e_y at the real tokens: one entry 1, the rest 0
    torch.testing.assert_close(hit[mask].sum(-1), torch.ones(int(mask.sum()), dtype=torch.float64))
    assert ((hit[mask] - 1).abs() < 1e-12).sum(-1).eq(1).all()
    assert u[~mask].abs().sum() == 0
