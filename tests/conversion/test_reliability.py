"""Bad inputs and faults on the conversion APIs (issue 21): each ends in a correct result or a
clear error naming the argument, file or layer, with the model unchanged after a failure."""
from __future__ import annotations

import math
import stat
import tempfile
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite import apply_conversion_config, conversion_config, convert, tune
from panther_lite.conversion.planning.allocation import LayerSpectrum, allocate_budget
from panther_lite.nn import SKLinear

pytest.importorskip("safetensors")
from panther_lite import from_pretrained, save_pretrained  # noqa: E402


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def snapshot(model):
    return [(n, type(m)) for n, m in model.named_modules()], {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    structure, state = snapshot(model)
    assert structure == before[0]
    assert state.keys() == before[1].keys() and all(torch.equal(state[k], before[1][k]) for k in state)


def closeness(x, reference):
    def evaluate(model):
        with torch.no_grad():
            return 1.0 - float((model(x) - reference).norm() / reference.norm())

    return evaluate


# ---------------------------------------------------------------------------------------- tune


def test_tune_uniform_does_not_pass_a_trial_that_compresses_nothing():
    """Below the per-layer minimum, uniform keeps every layer dense: that trial scores like
    the dense model but must not count as a pass."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), torch.randn(64, 8)
    with torch.no_grad():
        reference = model(x)
    report = tune(model, closeness(x, reference), tolerance=0.5, calibration_data=[x], allocation="uniform",
                  ratio_range=(0.01, 0.5), max_evaluations=3, progress=False)  # fmt: skip
    trace = report.attrs["search"]
    assert not trace[trace["budget"] < 1.0]["passed"].any()
    assert report.attrs["tune_budget"] == 0.5 and (report["status"] == "kept dense").all()


def test_tune_refuses_a_one_shot_iterator_up_front():
    model, x = mlp(), torch.randn(16, 32)
    calls = []
    with pytest.raises(TypeError, match="calibration_data.*iterator"):
        tune(model, lambda m: calls.append(1) or 1.0, tolerance=0.1, calibration_data=iter([x]), progress=False)
    assert calls == []


@pytest.mark.parametrize("wrap", [np.float32, np.float64, np.int64, lambda v: torch.tensor(v)])
def test_tune_accepts_numpy_and_0d_tensor_scores(wrap):
    model, x = mlp(), torch.randn(64, 32)
    with torch.no_grad():
        reference = model(x)
    score = closeness(x, reference)
    report = tune(model, lambda m: wrap(round(score(m), 3) if wrap is np.int64 else score(m)), tolerance=0.2,
                  calibration_data=[x], max_evaluations=2, progress=False)  # fmt: skip
    assert report.attrs["search"]["score"].dtype == float


def test_tune_refuses_a_tensor_with_several_values_as_a_score():
    with pytest.raises(TypeError, match="finite number"):
        tune(mlp(), lambda m: torch.ones(2), tolerance=0.1, progress=False)


# ------------------------------------------------------------------------- global allocation


def test_allocation_refuses_a_nan_importance():
    layer = LayerSpectrum(64, 64, True, torch.linspace(1, 0, 64), importance=math.nan)
    with pytest.raises(ValueError, match="importance"):
        allocate_budget([layer], 0.5 * 64 * 65)


def test_a_nan_output_gain_falls_back_to_unit_gains_loudly(monkeypatch):
    """A model whose output goes non-finite under the noise probe gets a NaN gain: the budget
    is still spent (relative errors alone), with a warning naming the layer and saying why;
    never everything kept dense at twice the budget."""
    from panther_lite.conversion.pipelines import whole_model

    def gains(model, records, run, metric):
        return {record.name: math.nan if record.name == "2" else 1.0 for record in records}

    monkeypatch.setattr(whole_model, "output_gains", gains)
    model, x = mlp(), torch.randn(64, 32)
    with pytest.warns(UserWarning, match=r"(?s)'2'.*non-finite.*gain"):
        report = convert(model, param_ratio=0.5, allocation="global", calibration_data=[x], progress=False)
    assert (report["status"] == "converted").sum() >= 2
    assert report["stored_params"].sum() <= 0.5 * report["dense_params"].sum()


# ------------------------------------------------------------------ configs and pretrained files


def tampered_config(model, **fields):
    config = conversion_config(model)
    config["layers"][0].update(fields)
    return config


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(low_rank=10**8), "low_rank"),
        (dict(num_terms=10**8), "num_terms"),
        (dict(low_rank=2**62, num_terms=2**62), "low_rank"),
        (dict(low_rank=64, num_terms=64), "num_terms"),
        (dict(low_rank=-3), "low_rank"),
        (dict(low_rank=2.5), "low_rank"),
        (dict(name="nope"), "nope"),
    ],
)
def test_apply_conversion_config_rejects_a_tampered_config_before_allocating(fields, match):
    converted = mlp()
    convert(converted, num_terms=1, low_rank=4, progress=False)
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        apply_conversion_config(model, tampered_config(converted, **fields))
    assert_unchanged(model, before)


def test_from_pretrained_factory_rejects_a_tampered_rank(tmp_path):
    import json

    model = mlp()
    convert(model, num_terms=1, low_rank=4, progress=False)
    save_pretrained(model, tmp_path)
    path = tmp_path / "panther_lite_config.json"
    record = json.loads(path.read_text())
    record["conversion"]["layers"][0]["low_rank"] = 10**8
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="low_rank"):
        from_pretrained(mlp, tmp_path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"\xff" * 8 + b"{}"])
def test_from_pretrained_names_a_truncated_or_garbage_weights_file(tmp_path, content):
    model = mlp()
    convert(model, num_terms=1, low_rank=4, progress=False)
    save_pretrained(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(content if content else weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(mlp, tmp_path)


def test_save_pretrained_stages_inside_the_target_directory(tmp_path, monkeypatch):
    """A read-only parent: the staging directory must live inside the target. chmod does not
    bind root, so the read-only parent is simulated by refusing any staging outside it."""
    target = tmp_path / "parent" / "model"
    target.mkdir(parents=True)
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is None or not str(dir).startswith(str(target)):
            raise PermissionError(f"[Errno 13] Permission denied: {dir!r}")
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    (tmp_path / "parent").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        model = mlp()
        convert(model, num_terms=1, low_rank=4, progress=False)
        save_pretrained(model, target)
    finally:
        (tmp_path / "parent").chmod(stat.S_IRWXU)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "panther_lite_config.json"]
    x = torch.randn(4, 32)
    torch.testing.assert_close(from_pretrained(mlp, target)(x), model(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------ calibration


@pytest.mark.parametrize("sequential", [False, True])
def test_a_non_finite_calibration_batch_is_named_with_its_layer(sequential):
    model, x = mlp(), torch.randn(16, 32)
    bad = x.clone()
    bad[3, 5] = math.inf
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"batch 1.*'0'|'0'.*batch 1"):
        convert(model, num_terms=1, low_rank=4, calibration_data=[x, bad], sequential=sequential, progress=False)
    assert_unchanged(model, before)


@pytest.mark.parametrize("sequential", [False, True])
def test_a_none_batch_is_a_clear_error(sequential):
    model, x = mlp(), torch.randn(16, 32)
    for data in ([None, x], [x, None]):
        with pytest.raises(TypeError, match="batch 0 is None|batch 1 is None"):
            convert(model, num_terms=1, low_rank=4, calibration_data=data, sequential=sequential, progress=False)
        assert not any(isinstance(m, SKLinear) for m in model.modules())


def test_a_sequential_batch_of_the_wrong_width_names_the_layer():
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"layer '0' expects.*features\) 32"):
        convert(model, num_terms=1, low_rank=4, calibration_data=[torch.randn(8, 32), torch.randn(8, 31)],
                sequential=True, progress=False)  # fmt: skip
    assert_unchanged(model, before)


def test_a_failed_convert_restores_buffers_the_forward_changed():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls += 1
            self.train()  # a user model that switches itself to training: BatchNorm stats move
            return self.body(x)

    torch.manual_seed(0)
    model = Counting()
    before = snapshot(model)
    with pytest.raises(ValueError):
        convert(model, num_terms=1, low_rank=4, calibration_data=[torch.randn(8, 32), torch.randn(8, 7)],
                progress=False)  # fmt: skip
    assert_unchanged(model, before)


# ------------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    "wrap",
    [
        nn.utils.parametrizations.spectral_norm,
        nn.utils.parametrizations.weight_norm,
        nn.utils.spectral_norm,
        nn.utils.weight_norm,
    ],
)
def test_normalised_weights_are_skipped_with_a_reason(wrap):
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wrap(model[2])
    report = convert(model, num_terms=1, low_rank=4, progress=False)
    row = report.set_index("name").loc["2"]
    assert row["status"] == "skipped" and "norm" in row["reason"]
    assert not isinstance(model[2], SKLinear) and isinstance(model[0], SKLinear)


def test_public_api_still_exports_these_names():
    for name in ("tune", "save_pretrained", "from_pretrained", "apply_conversion_config", "convert"):
        assert hasattr(panther_lite, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.long])
def test_a_calibration_batch_of_another_dtype_names_the_layer(dtype):
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"layer '0' has torch.float32 weights.*{dtype}"):
        convert(model, num_terms=1, low_rank=4, calibration_data=[torch.ones(4, 32, dtype=dtype)], progress=False)
    assert_unchanged(model, before)


def test_a_config_may_hold_numpy_integers():
    converted = mlp()
    convert(converted, num_terms=1, low_rank=4, progress=False)
    config = tampered_config(converted, low_rank=np.int64(4), num_terms=np.int32(1))
    model = apply_conversion_config(mlp(), config)
    assert isinstance(model[0], SKLinear) and type(model[0].low_rank) is int and model[0].low_rank == 4
