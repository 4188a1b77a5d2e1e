"""Fixtures shared by the conversion tests: trained digits models (trained once per
session), small named models and a check that a model is unchanged."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits


@pytest.fixture(scope="session")
def digits():
    """Digits pixels scaled to [0, 1] (float64), split 50/50 with a fixed permutation (a
    large test set, so one point of accuracy is nine images)."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float64) / 16
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = len(x) // 2
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def train(model, x, y, epochs, seed):
    """AdamW with weight decay (what low-rank compression assumes of a trained model)."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1.0)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(64):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def trained_mlp(digits):
    x, y, _, _ = digits
    torch.manual_seed(2)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).double()
    return train(mlp, x, y, epochs=20, seed=2)


@pytest.fixture(scope="session")
def trained_cnn(digits):
    x, y, _, _ = digits
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1024, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).double()
    return train(cnn, x.view(-1, 1, 8, 8), y, epochs=6, seed=0)


@pytest.fixture
def accuracy():
    """``accuracy(model, x, y)``: the share of ``x`` whose argmax output is ``y``."""

    def measure(model, x, y):
        with torch.no_grad():
            return (model(x).argmax(1) == y).double().mean().item()

    return measure


@pytest.fixture
def named_model():
    """A factory of a small model with nested names: enc.{q, v, conv}, head, norm."""

    def build():
        torch.manual_seed(0)
        return nn.ModuleDict(
            {
                "enc": nn.ModuleDict({"q": nn.Linear(32, 32), "v": nn.Linear(32, 32), "conv": nn.Conv2d(4, 8, 3)}),
                "head": nn.Linear(32, 32),
                "norm": nn.LayerNorm(32),
            }
        )

    return build


@pytest.fixture
def cnn_mlp_model():
    """A factory of a float64 conv + MLP model taking (N, 3, 6, 6) inputs."""

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 64), nn.ReLU(), nn.Linear(64, 64)
        ).double()

    return build


@pytest.fixture
def assert_unchanged():
    """``check(model, state_before, types_before=None)``: the model's state_dict (and module
    types) equal the snapshot taken before."""

    def check(model, state_before, types_before=None):
        state = model.state_dict()
        assert list(state) == list(state_before)
        for key, value in state_before.items():
            assert torch.equal(state[key], value), key
        if types_before is not None:
            assert [type(m) for m in model.modules()] == types_before

    return check


class StoppedRun(KeyboardInterrupt):
    """A compress_checkpoint run stopped on purpose (as Ctrl-C would stop it)."""


@pytest.fixture
def stopped_after_first_block(monkeypatch):
    """``with stopped_after_first_block(): compress_checkpoint(...)``: the run stops right after
    its first block is committed (the block expects that stop)."""
    from panther_lite.conversion.saving.resume_state import RunState

    @contextlib.contextmanager
    def stopped():
        commit = RunState.commit

        def commit_then_stop(state, count, *args, **kwargs):
            commit(state, count, *args, **kwargs)
            if count == 1:
                raise StoppedRun

        with monkeypatch.context() as patch:
            patch.setattr(RunState, "commit", commit_then_stop)
            with pytest.raises(StoppedRun):
                yield

    return stopped
