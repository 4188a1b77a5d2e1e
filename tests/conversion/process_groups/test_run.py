"""``convert`` across processes (gloo on the CPU, ranks started by ``launch.py``): the model two
processes give equals one process's within float64 summation-order rounding, for uniform,
global and sequential fits, each layer fitted by one of the processes; ``tune`` decides on process 0's score; options not distributed yet
raise naming themselves."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from outcomes import ATOL, RTOL, across, assert_same, one_process  # noqa: E402
from scenario import batches, counting_fits, tiny_llama  # noqa: E402

pytest.importorskip("transformers")


@pytest.mark.parametrize("options", [
    dict(param_ratio=0.5),
    dict(param_ratio=0.5, allocation="global", sequential=True, shrinkage=0.1),
], ids=["uniform", "global-sequential"])
def test_two_processes_give_the_one_process_model(options, tmp_path):
    assert_same(one_process(options), across(2, options, tmp_path))


def test_the_whole_model_pipeline_and_global_gains_across_processes(tmp_path):
    options = dict(param_ratio=0.5, allocation="global", blocks=False)
    assert_same(one_process(options), across(2, options, tmp_path))


@pytest.mark.parametrize("options", [
    dict(model="mixtral", param_ratio=0.5),
    dict(model="mixtral", param_ratio=0.5, allocation="global", sequential=True),
], ids=["uniform", "global-sequential"])
def test_a_mixture_of_experts_model_across_processes(options, tmp_path):
    assert_same(one_process(options), across(2, options, tmp_path))


def test_options_not_distributed_yet_are_refused_naming_them(tmp_path):
    out = tmp_path / "refusals.pt"
    results = launch(2, dict(mode="refusals"), out)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    found = torch.load(out)
    assert found["callable"].startswith("NotImplementedError") and "callable" in found["callable"]
    assert found["odd batches"].startswith("ValueError") and "shrinkage='auto'" in found["odd batches"]
    assert found["one batch"].startswith("ValueError") and "fewer than the processes" in found["one batch"]
    assert found["output Fisher"].startswith("NotImplementedError") and "output_fisher=True" in found["output Fisher"]


def _fits_split_on_four_ranks(options: dict, out: Path) -> None:
    import panther_lite

    alone = dict(options)
    model, built = tiny_llama(alone.pop("model", "llama")), []
    with counting_fits(model, built):
        report = panther_lite.convert(model, calibration_data=batches(), progress=False, **alone)
    results = launch(4, dict(mode="count fits", **options), out)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    ranks = [torch.load(f"{out}.{rank}") for rank in range(4)]
    assert sorted(name for found in ranks for name in found["built"]) == sorted(built)  # each layer fitted once
    assert sum(bool(found["built"]) for found in ranks) > 1, [found["built"] for found in ranks]  # by several ranks
    rows = report["calibration_rows"].fillna(-1).astype(int).tolist()
    assert all(found["rows"] == rows for found in ranks)  # every rank's rows counted once, on every rank
    for found in ranks[1:]:
        for name, tensor in ranks[0]["state"].items():
            assert torch.equal(found["state"][name], tensor), name  # every rank swapped in the same fits
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][name], tensor, atol=ATOL, rtol=RTOL, msg=name)


def test_four_processes_fit_each_layer_on_one_rank_and_hold_the_same_model(tmp_path):
    # the split of the fits over four ranks, with the planning most likely to desynchronise them (global
    # sizes, sequential statistics); a uniform plan over two ranks runs in test_two_processes_give_the_one_process_model
    cases = [dict(param_ratio=0.5, allocation="global", sequential=True, shrinkage=0.1),
             dict(model="mixtral", param_ratio=0.5, allocation="global", sequential=True)]
    for index, options in enumerate(cases):
        _fits_split_on_four_ranks(options, tmp_path / f"case{index}.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_statistics_on_the_gpu_travel_through_gloo(tmp_path):
    options = dict(param_ratio=0.5, calibration_device="cuda")
    assert_same(one_process(options), across(2, options, tmp_path))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one GPU per rank)")
def test_nccl_with_one_gpu_per_rank(tmp_path):
    options = dict(param_ratio=0.5, allocation="global", calibration_device="cuda")
    assert_same(one_process(options), across(2, options, tmp_path, extra_env={"TEST_BACKEND": "nccl"}))


def test_an_explicit_process_group(tmp_path):
    options = dict(param_ratio=0.5, allocation="global")
    assert_same(one_process(options), across(2, {**options, "explicit_group": True}, tmp_path))


def test_tune_across_processes_decides_on_the_first_process_score(tmp_path):
    import panther_lite
    from scenario import batches, logits_score, tiny_llama

    options = dict(tolerance=0.005, max_evaluations=3, ratio_range=[0.1, 1.0], sensitivity="norm")
    model = tiny_llama()
    report = panther_lite.tune(model, logits_score(model), calibration_data=batches(), progress=False, **options)
    passed = report.attrs["search"]["passed"].tolist()
    assert False in passed[1:] and True in passed[1:]  # a budget failed, another passed
    got = across(2, dict(mode="tune", **options), tmp_path)  # process 1's evaluate returns -1e9: unused
    assert got["search"] == report.attrs["search"]["budget"].tolist()
    assert_same((model.state_dict(), report["calibration_rows"].fillna(-1).astype(int).tolist(), None), got)
