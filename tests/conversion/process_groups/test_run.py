"""``convert`` across processes (gloo on the CPU, ranks started by ``launch.py``): the model two
processes give equals one process's within float64 summation-order rounding, for uniform,
global and sequential fits; options not distributed yet raise naming themselves."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from outcomes import across, assert_same, one_process  # noqa: E402

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
    assert found["tune"].startswith("NotImplementedError") and "tune" in found["tune"]


def test_four_processes_give_the_one_process_model(tmp_path):
    options = dict(param_ratio=0.5)
    assert_same(one_process(options), across(4, options, tmp_path))


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
