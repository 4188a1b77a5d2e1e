"""Distillation across processes (gloo on the CPU): batch ``i`` runs on process ``i % world`` (its
teacher outputs cached there too), a step is the one-process step (its batch's gradient summed
with the others' zeros), the held-back losses added in batch order, so two processes distill to
the one-process model; processes holding other batches, or too few, are a clear error."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from scenario import batches, tiny_llama  # noqa: E402

from panther_lite.conversion.process_groups.distillation import batch_owner, check_cache_share  # noqa: E402

pytest.importorskip("transformers")

# A step's gradient is the one process's plus exact zeros and the losses are added in the one
# process's order, so the ranks repeat the one-process arithmetic; what can differ is the BLAS
# rounding of the forward and backward (one thread per rank here, the test process's threads
# there), which Adam's normalised steps carry into the parameters at about lr times ~1e-7:
# the refinement tests' tolerance.
ATOL, RTOL = 1e-5, 1e-4
DISTILL = dict(max_steps=6, eval_every=2, lr=1e-3, patience=4)


def _one_process(options: dict) -> dict:
    import panther_lite

    options = dict(options)
    teacher = tiny_llama()
    model, data = copy.deepcopy(teacher), batches(options.pop("batches", 4))
    panther_lite.convert(model, calibration_data=data, param_ratio=0.3, progress=False)
    if options.pop("cached", False):
        teacher = panther_lite.teacher_outputs(teacher, data, top_k=8, progress=False)
    result = panther_lite.distill(model, teacher, data, progress=False, **options)
    return {"state": model.state_dict(), "history": result.history, "steps": result.steps,
            "best_step": result.best_step}


@pytest.mark.parametrize("cached, autocast", [(False, None), (True, "float16")],
                         ids=["live-teacher", "cached-across-float16"])
def test_two_processes_distill_as_one_process(cached, autocast, tmp_path):
    """The cache split across the ranks, in float16: every rank scales its loss (zero where it holds no
    batch) and unscales the summed gradients alike. (A float32 cache across processes runs in
    tests/cli/test_torchrun.py's distillation.)"""
    options = dict(DISTILL, cached=cached, autocast=autocast)
    expected = _one_process(options)
    results = launch(2, dict(options, mode="distill"), tmp_path / "out.pt")
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    got = torch.load(tmp_path / "out.pt")
    assert (got["steps"], got["best_step"]) == (expected["steps"], expected["best_step"])
    assert expected["best_step"] > 0  # the steps changed the model
    for (step, train, held), (step_1, train_1, held_1) in zip(got["history"], expected["history"]):
        assert step == step_1 and held == pytest.approx(held_1, rel=RTOL)
        assert train == pytest.approx(train_1, rel=RTOL, nan_ok=True)
    for name, tensor in expected["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, atol=ATOL, rtol=RTOL, msg=name)


class _Ranks:
    """A stand-in for a process group: what each rank would pass to the all-gather."""

    def __init__(self, rank: int, world: int, seen: list) -> None:
        self.rank, self.world, self.seen = rank, world, seen

    def gather_objects(self, value, what: str) -> list:
        return [value if rank == self.rank else other for rank, other in enumerate(self.seen)]


def _seen(*datas) -> list:
    """What every rank gathers for these batch lists (one per rank)."""
    found = []
    for data in datas:
        probe = _Ranks(0, 1, [None])
        probe.gather_objects = lambda value, what: found.append(value) or [value]
        batch_owner(probe, data, "distill")
    return found


def test_batch_i_runs_on_process_i_mod_world():
    data = batches(5)
    owned = batch_owner(_Ranks(1, 2, _seen(data, data)), data, "distill")
    assert [index for index in range(5) if owned(index)] == [1, 3]
    assert all(batch_owner(None, data, "distill")(index) for index in range(5))


def test_fewer_batches_than_processes_or_other_batches_are_clear_errors():
    data = batches(2)
    with pytest.raises(ValueError, match=r"distill across 3 processes: data holds 2 batch\(es\).*a process would have none"):
        batch_owner(_Ranks(0, 3, _seen(data, data, data)), data, "distill")
    with pytest.raises(ValueError, match=r"the batches of process 1 differ from those of process 0 \(1 and 2 batches"):
        batch_owner(_Ranks(0, 2, _seen(data, data[:1])), data, "distill")


def test_a_cache_of_another_share_is_refused():
    check_cache_share((0, 1), _Ranks(1, 2, []))  # a whole cache serves any process
    check_cache_share((1, 2), _Ranks(1, 2, []))
    with pytest.raises(ValueError, match="share of process 1 of 2.*distill runs as one process"):
        check_cache_share((1, 2), None)
