"""Mixtures of experts written as per-expert ``nn.Linear`` modules (older code: a ``gate``
``nn.Linear`` router and an ``experts`` ``nn.ModuleList`` of ``w1/w2/w3`` MLPs): the router stays
dense, each expert is calibrated on the tokens routed to it only, and an expert that received
fewer rows than it has inputs is fitted to its weight alone, with the report saying so."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import panther_lite
from panther_lite.nn import SKLinear

pytestmark = pytest.mark.usefixtures("one_thread")
HIDDEN, INTER, EXPERTS, TOKENS, RARE_TOKENS = 16, 24, 4, 30, 4
RARE = 3


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(HIDDEN, INTER, bias=False), nn.Linear(INTER, HIDDEN, bias=False), nn.Linear(HIDDEN, INTER, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    """Mixtral's block as transformers 4 wrote it: top-2 of a Linear router, a loop over experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, hidden):
        x = hidden.reshape(-1, HIDDEN)
        weights, index = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, position = torch.where(index == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, position, None])
        return out.reshape(hidden.shape)


def model_and_data(seed: int = 0):
    """The block (in float64) and batches whose first RARE_TOKENS tokens alone pick expert RARE
    (its router row is −1 everywhere; those tokens are shifted to −3, the others to +1)."""
    torch.manual_seed(seed)
    model = nn.Sequential(SparseMoe()).double().eval()
    with torch.no_grad():
        model[0].gate.weight[RARE] = -1.0
    generator = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(3):
        x = torch.randn(1, TOKENS, HIDDEN, generator=generator, dtype=torch.float64) + 1.0
        x[:, :RARE_TOKENS] -= 4.0
        batches.append(x)
    return model, batches


def routed_inputs(model, batches, e):
    with torch.no_grad():
        rows = []
        for x in batches:
            flat = x.reshape(-1, HIDDEN)
            index = torch.topk(model[0].gate(flat).softmax(-1), 2).indices
            rows.append(flat[(index == e).any(-1)])
        return torch.cat(rows)


@pytest.fixture(scope="module")
def converted():
    model, batches = model_and_data()
    dense = copy.deepcopy(model)
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, progress=False).set_index("name")
    return model, dense, batches, report


def test_the_router_stays_dense_with_its_reason(converted):
    model, _, _, report = converted
    assert type(model[0].gate) is nn.Linear
    assert report.loc["0.gate", "status"] == "kept dense"
    assert report.loc["0.gate", "reason"].startswith("a router: its 4 outputs choose among the experts at '0.experts'")


def test_each_expert_is_calibrated_on_its_routed_tokens_only(converted):
    model, dense, batches, report = converted
    for e in range(RARE):
        x = routed_inputs(dense, batches, e)
        assert x.shape[0] >= HIDDEN  # enough rows: a calibrated fit
        name = f"0.experts.{e}.w1"
        assert report.loc[name, "init"] == "calibrated" and report.loc[name, "reason"] == ""
        weight = dense.get_submodule(name).weight
        with torch.no_grad():
            expected = float((x @ (model.get_submodule(name).effective_weight() - weight).t()).norm() / (x @ weight.t()).norm())
        assert report.loc[name, "output_error"] == pytest.approx(expected, rel=1e-9)


def test_an_expert_with_fewer_rows_than_inputs_is_fitted_data_free(converted):
    model, dense, batches, report = converted
    rows = routed_inputs(dense, batches, RARE).shape[0]
    assert 0 < rows < HIDDEN
    for projection in ("w1", "w3"):
        name = f"0.experts.{RARE}.{projection}"
        assert report.loc[name, "init"] == "svd" and report.loc[name, "reason"] == (
            f"routed expert: received {rows} calibration rows, fewer than its {HIDDEN} inputs: fitted to its weight "
            "alone (data-free)"
        )
        layer = model.get_submodule(name)
        free = SKLinear.from_linear(dense.get_submodule(name), layer.num_terms, layer.low_rank)
        torch.testing.assert_close(layer.effective_weight(), free.effective_weight(), rtol=1e-10, atol=1e-12)
        assert report.loc[name, "output_error"] == report.loc[name, "output_error"]  # measured on its rows (not NaN)
