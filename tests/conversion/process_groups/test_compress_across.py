"""``compress_checkpoint`` across processes (gloo): rank 0 alone writes the output, the same files
(the same tensors within summation-order rounding, the same row counts) as one process, in memory
and streamed; a rank killed mid-run stops the other with a clear error and leaves the staging
directory, and a resume on another number of processes finishes with the one-process output."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from scenario import batches, tiny_llama  # noqa: E402

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def _tensors(directory: Path) -> dict:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(safetensors.load_file(str(path)))
    return found


def test_two_processes_write_the_one_process_checkpoint(tmp_path):
    import panther_lite

    source = tmp_path / "source"
    tiny_llama().save_pretrained(source)
    alone = tmp_path / "alone"
    panther_lite.compress_checkpoint(source, alone, calibration_data=batches(), in_memory=True, param_ratio=0.5,
                                     progress=False)
    across = tmp_path / "across"
    results = launch(2, dict(mode="compress", source=str(source), in_memory=True, param_ratio=0.5), across)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert sorted(p.name for p in across.iterdir()) == sorted(p.name for p in alone.iterdir())
    assert not list(tmp_path.glob(".*partial*"))
    _assert_same_output(alone, across)


# float64 Grams summed per rank then across ranks instead of batch by batch: the statistics differ
# in the last bits (~1e-16 relative), the fits by that times their conditioning.
ATOL, RTOL = 1e-5, 1e-4
STREAMED = dict(param_ratio=0.5, allocation="global", sequential=True, shrinkage=0.1)


def _assert_same_output(expected: Path, got: Path) -> None:
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in expected.iterdir())
    want, have = _tensors(expected), _tensors(got)
    assert want.keys() == have.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(have[name], tensor, atol=ATOL, rtol=RTOL, msg=name)
    import pandas as pd

    rows = [pd.read_csv(directory / "report.csv")["calibration_rows"].fillna(-1).tolist() for directory in (expected, got)]
    assert rows[0] == rows[1]  # every rank's rows counted once


def _alone(source: Path, out: Path, **options):
    import panther_lite

    return panther_lite.compress_checkpoint(source, out, calibration_data=batches(), progress=False, **options)


def _stream_alone_and_across(world: int, source: Path, tmp_path: Path, options: dict) -> None:
    """``source`` streamed by one process (to ``alone``) and by ``world`` (to ``across``): the same output."""
    report = _alone(source, tmp_path / "alone", **options)
    assert report.attrs["pipeline"].startswith("out of core")
    results = launch(world, dict(mode="compress", source=str(source), **options), tmp_path / "across")
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert not list(tmp_path.glob(".*partial*"))
    _assert_same_output(tmp_path / "alone", tmp_path / "across")


def test_two_processes_stream_the_one_process_checkpoint(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "source")
    _stream_alone_and_across(2, tmp_path / "source", tmp_path, STREAMED)


def test_a_killed_rank_stops_the_other_and_one_process_resumes_the_run(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    tiny_llama().save_pretrained(source)
    _alone(source, tmp_path / "alone", **STREAMED)
    results = launch(2, dict(mode="compress", source=str(source), **STREAMED), out, extra_env={
        "TEST_DIE_RANK": "1", "TEST_DIE_AT": "after block 1", "TEST_COLLECTIVE_TIMEOUT": "20"})
    (survivor_code, survivor_err), (dead_code, _) = results
    assert dead_code == 3 and survivor_code != 0
    assert "DistributedError: panther_lite: the barrier (the hidden states after block 1 written)" in survivor_err
    assert "rerun with resume=True" in survivor_err
    assert not out.exists() and (tmp_path / ".out.partial").is_dir()  # block 0 committed: kept
    _alone(source, out, resume=True, **STREAMED)  # another world size than the killed run's
    _assert_same_output(tmp_path / "alone", out)
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.parametrize("rank, where, quoted", [
    (0, "gains", "RuntimeError: injected failure in the gains pass"),
    (0, "commit", "OSError: [Errno 28] writing "),  # the disk-full error as the library words it
    (1, "shard", "OSError: [Errno 28] injected: No space left on device"),
], ids=["rank-0-gains-pass", "rank-0-writing-block-1", "rank-1-writing-its-hidden-states"])
def test_a_rank_failing_mid_run_stops_the_other_quoting_it_and_the_run_resumes(rank, where, quoted, tmp_path):
    """The failing rank's process lives on (an exception, not a kill): the other rank learns of it
    at once through the store, not at the collective timeout (600 s here, past the launch's bound)."""
    source, out = tmp_path / "source", tmp_path / "out"
    tiny_llama().save_pretrained(source)
    _alone(source, tmp_path / "alone", **STREAMED)
    results = launch(2, dict(mode="compress", source=str(source), **STREAMED), out, timeout=240, extra_env={
        "TEST_FAIL_RANK": str(rank), "TEST_FAIL_IN": where, "TEST_COLLECTIVE_TIMEOUT": "600"})
    (failed_code, failed_err), (other_code, other_err) = results[rank], results[1 - rank]
    assert failed_code != 0 and quoted in failed_err, failed_err[-3000:]
    told = [line for line in other_err.splitlines() if "RankFailed: " in line]
    assert other_code != 0 and told, other_err[-3000:]
    assert f"RankFailed: panther_lite: rank {rank} of 2 processes failed ({quoted}" in told[-1]
    assert "injected" in told[-1] and f"; rank {1 - rank} stopped at the " in told[-1]
    assert told[-1].endswith("rerun with resume=True (--resume)")
    assert not out.exists()
    _alone(source, out, resume=True, **STREAMED)  # from block 0 when it was written, else afresh
    _assert_same_output(tmp_path / "alone", out)
    assert not list(tmp_path.glob(".*partial*"))


def test_a_one_process_run_resumes_on_two_processes(tmp_path, monkeypatch):
    from panther_lite.conversion.saving.resume_state import RunState

    source, out = tmp_path / "source", tmp_path / "out"
    tiny_llama().save_pretrained(source)
    _alone(source, tmp_path / "alone", **STREAMED)
    commit = RunState.commit

    def commit_then_stop(state, finished, *args, **kwargs):
        commit(state, finished, *args, **kwargs)
        raise KeyboardInterrupt  # stopped once block 0 is written

    monkeypatch.setattr(RunState, "commit", commit_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _alone(source, out, **STREAMED)
    monkeypatch.undo()
    results = launch(2, dict(mode="compress", source=str(source), resume=True, **STREAMED), out)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    _assert_same_output(tmp_path / "alone", out)


def _save_under_the_model_names(model, directory: Path) -> None:
    """``model``'s checkpoint with its own tensor names (transformers writes Mixtral's experts in
    the per-expert layout, which streams too: the 4-process test reads that one); a tied tensor once."""
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    safetensors.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("options", [
    dict(param_ratio=0.5),
    dict(param_ratio=0.5, allocation="global", sequential=True),
], ids=["uniform", "global-sequential"])
def test_two_processes_stream_a_mixture_of_experts_checkpoint(options, tmp_path):
    _save_under_the_model_names(tiny_llama("mixtral"), tmp_path / "source")
    _stream_alone_and_across(2, tmp_path / "source", tmp_path, options)


@pytest.mark.parametrize("model, options", [
    ("llama", STREAMED),
    ("mixtral", dict(param_ratio=0.5, allocation="global", sequential=True)),
], ids=["global-sequential", "mixtral-global-sequential"])
def test_four_processes_stream_the_one_process_checkpoint(model, options, tmp_path):
    """4 ranks of 4 batches: one batch each, so every sum gathers all four ranks (ATOL, RTOL above).
    Uniform fits: across two ranks, in memory (``test_run.py``) and streamed (above)."""
    tiny_llama(model).save_pretrained(tmp_path / "source")  # Mixtral: the per-expert layout on disk
    _stream_alone_and_across(4, tmp_path / "source", tmp_path, options)


def test_two_processes_stream_and_refine_the_one_process_checkpoint(tmp_path):
    import pandas as pd

    tiny_llama().save_pretrained(tmp_path / "source")
    options = dict(param_ratio=0.2, refine=dict(max_steps=4, lr=1e-3, patience=4))
    _stream_alone_and_across(2, tmp_path / "source", tmp_path, options)  # refinement's tolerance: test_refinement.py
    steps = [pd.read_csv(tmp_path / name / "refinement.csv")["steps"].tolist() for name in ("alone", "across")]
    assert steps[0] == steps[1] and steps[0]
