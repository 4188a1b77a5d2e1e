"""compress_checkpoint: tiny random-init transformers checkpoints (one file and sharded) streamed
block by block give the model convert gives in memory (uniform, global + sequential, refine,
random tokens, rank_pattern and selection); one block is loaded at a time and each is written
before the next is read; a model that cannot be streamed is loaded whole with the reason; a run
stopped after block k resumes with the same result bit for bit, redoing only what was left; a
staging directory from another checkpoint, other options or other data is refused."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion.pipelines import out_of_core  # noqa: E402
from panther_lite.conversion.pipelines.skeleton_parts import SkeletonParts  # noqa: E402
from panther_lite.conversion.saving.checkpoint_files import CheckpointFiles  # noqa: E402
from panther_lite.conversion.saving.resume_state import RunState  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 40
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*gradient_checkpointing")]


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "gpt2":  # Conv1D layers, lm_head tied to the embeddings
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4,
                                                                    n_positions=32))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip


def _save(name: str, directory: Path, sharded: bool = False, seed: int = 0) -> Path:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        _model(name, seed).save_pretrained(str(directory), safe_serialization=True,
                                           **({"max_shard_size": "20KB"} if sharded else {}))
    finally:
        transformers_logging.enable_progress_bar()
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{name: directory}``: LLaMA in one file and sharded, GPT-2, BERT."""
    root = tmp_path_factory.mktemp("saved")
    found = {name: _save(name, root / name) for name in ("llama", "gpt2", "bert")}
    found["llama-sharded"] = _save("llama", root / "llama-sharded", sharded=True)
    assert len(list(found["llama-sharded"].glob("*.safetensors"))) > 3
    return found


def _batches(count: int = 3, seed: int = 1):
    """Batches with an attention mask, the last row of each padded (what the command makes)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5:] = 0
        batches.append(dict(input_ids=torch.randint(0, VOCAB, (2, 8), generator=generator), attention_mask=mask))
    return batches


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _in_memory(model_dir: Path, batches, **options):
    model = transformers.AutoModelForMaskedLM if "bert" in model_dir.name else transformers.AutoModelForCausalLM
    model = model.from_pretrained(str(model_dir)).eval()
    report = panther_lite.convert(model, calibration_data=batches, progress=False, **options)
    return model, report


def _relative_logit_error(model_dir: Path, output: Path, expected, batches) -> float:
    auto = transformers.AutoModelForMaskedLM if "bert" in model_dir.name else transformers.AutoModelForCausalLM
    loaded = panther_lite.from_pretrained(auto, output).eval()
    with torch.no_grad():
        pairs = [(loaded(**b).logits, expected(**b).logits) for b in batches]
    return max(float((a - e).norm() / e.norm()) for a, e in pairs)


MODES = {
    "uniform": ("llama-sharded", dict(param_ratio=0.5)),
    "global + sequential": ("llama-sharded", dict(param_ratio=0.5, allocation="global", sequential=True, seed=0)),
    "gpt2 uniform": ("gpt2", dict(param_ratio=0.5)),
    "gpt2 global + sequential": ("gpt2", dict(param_ratio=0.5, allocation="global", sequential=True)),
    "bert global": ("bert", dict(param_ratio=0.5, allocation="global")),
    "global + sequential + output Fisher": ("llama-sharded", dict(param_ratio=0.5, allocation="global", sequential=True,
                                                                  output_fisher=True)),
    "gpt2 output Fisher": ("gpt2", dict(param_ratio=0.5, output_fisher=True)),
    "refine": ("llama", dict(param_ratio=0.5, refine=dict(max_steps=3))),
    "rank_pattern, target and exclude": ("llama", dict(param_ratio=0.5, rank_pattern={"up_proj": 0.3},
                                                       target_modules=["up_proj", "down_proj", "lm_head", "q_proj"],
                                                       exclude_modules=["layers.1.self_attn.q_proj"])),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_streamed_checkpoint_is_the_model_convert_makes_in_memory(mode, saved, tmp_path):
    name, options = MODES[mode]
    batches, before = _batches(), _tree(saved[name])
    report = panther_lite.compress_checkpoint(saved[name], tmp_path / "out", calibration_data=batches, progress=False,
                                              **options)
    expected, expected_report = _in_memory(saved[name], batches, **options)
    assert report.attrs["pipeline"].startswith("out of core: ") and report.attrs["summary"] == expected_report.attrs["summary"]
    assert list(report["low_rank"].fillna(0)) == list(expected_report["low_rank"].fillna(0))
    assert list(report["status"]) == list(expected_report["status"]) and (report["status"] == "converted").any()
    assert _relative_logit_error(saved[name], tmp_path / "out", expected, batches) <= 1e-4
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "out") and _tree(saved[name]) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging directory left


def test_random_token_batches_stream_like_any_batches(saved, tmp_path, word_tokenizer):
    tokenizer = word_tokenizer()
    skeleton = _model("llama")
    batches = _batches() + panther_lite.random_token_batches(tokenizer, 6, 8, batch_size=4, model=skeleton)
    panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=batches, param_ratio=0.5,
                                     progress=False)
    expected, _ = _in_memory(saved["llama"], batches, param_ratio=0.5)
    assert _relative_logit_error(saved["llama"], tmp_path / "out", expected, batches) <= 1e-4


class _Events:
    """Every load, release and write of a part, in order (monkeypatched into the pipeline)."""

    def __init__(self, monkeypatch) -> None:
        self.log = []
        load, release, write = SkeletonParts.load, SkeletonParts.release, out_of_core.write_part
        monkeypatch.setattr(SkeletonParts, "load", lambda parts, part: self.log.append(("load", part)) or load(parts, part))
        monkeypatch.setattr(SkeletonParts, "release",
                            lambda parts, part: self.log.append(("release", part)) or release(parts, part))
        monkeypatch.setattr(out_of_core, "write_part", lambda path, tensors: self.log.append(("write", path.stem))
                            or write(path, tensors))

    def most_blocks_loaded(self) -> int:
        loaded, most = set(), 0
        for event, part in self.log:
            if part is not None and event in ("load", "release"):
                (loaded.add if event == "load" else loaded.discard)(part)
                most = max(most, len(loaded))
        return most


@pytest.mark.parametrize("options", [dict(), dict(allocation="global", sequential=True)], ids=["uniform", "global"])
def test_one_block_is_loaded_at_a_time_and_written_before_the_next_is_read(options, saved, tmp_path, monkeypatch):
    events = _Events(monkeypatch)
    panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(), param_ratio=0.5,
                                     progress=False, **options)
    assert events.most_blocks_loaded() == 1
    fitting = events.log[events.log.index(("release", None)):]  # the embeddings and head: out while blocks fit
    assert fitting == [("release", None), ("load", 0), ("write", "block-00000"), ("release", 0), ("load", 1),
                       ("write", "block-00001"), ("release", 1), ("load", 2), ("write", "block-00002"),
                       ("release", 2), ("load", None), ("write", "outside")]
    assert events.log.count(("load", None)) == 2 and events.log[0] == ("load", None)
    # the capture (once per batch: 3) and the fits; global: + the first batch's forward and reverse passes for the
    # gains (the reverse pass stops before block 0) and the spectra
    reads = 3 + (1 if not options else 4)
    assert events.log.count(("load", 2)) == reads and events.log.count(("load", 0)) == reads - (1 if options else 0)


@pytest.mark.parametrize("why,options,data", [
    ("blocks=False", dict(blocks=False), _batches()),
    ("calibration_data is a callable", dict(), lambda model: model(**_batches()[0])),
])
def test_a_model_that_cannot_be_streamed_is_loaded_whole_saying_why(why, options, data, saved, tmp_path):
    with pytest.warns(UserWarning, match=f"loading .* whole: {why}"):
        report = panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=data,
                                                  param_ratio=0.5, progress=False, **options)
    assert f"(the model loaded whole: {why}" in report.attrs["pipeline"]
    expected, _ = _in_memory(saved["llama"], data, param_ratio=0.5, **options)
    assert _relative_logit_error(saved["llama"], tmp_path / "out", expected, _batches()) == 0


class _Stop(KeyboardInterrupt):
    pass


def _stop_after(monkeypatch, finished: int) -> None:
    """Make the run stop (as Ctrl-C would) right after block ``finished - 1`` is committed."""
    commit = RunState.commit

    def commit_then_stop(state, count, record, streams, outside=False):
        commit(state, count, record, streams, outside)
        if count == finished and not outside:
            raise _Stop

    monkeypatch.setattr(RunState, "commit", commit_then_stop)


RESUMED = {"uniform": dict(param_ratio=0.5),
           "global + sequential + refine": dict(param_ratio=0.5, allocation="global", sequential=True,
                                                refine=dict(max_steps=2)),
           "sequential + output Fisher": dict(param_ratio=0.5, sequential=True, output_fisher=True)}


@pytest.mark.parametrize("options", list(RESUMED.values()), ids=list(RESUMED))
def test_a_stopped_run_resumes_after_the_last_block_written_bit_for_bit(options, saved, tmp_path, monkeypatch):
    model_dir, batches, before = saved["llama-sharded"], _batches(), _tree(saved["llama-sharded"])
    torch.manual_seed(0)
    whole = panther_lite.compress_checkpoint(model_dir, tmp_path / "whole", calibration_data=batches, progress=False,
                                             **options)
    with monkeypatch.context() as patch:
        _stop_after(patch, 2)
        with pytest.raises(_Stop):
            panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, progress=False,
                                             **options)
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.partial").is_dir() and _tree(model_dir) == before
    with pytest.raises(ValueError, match="holds an unfinished run .* pass resume=True"):
        panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, **options)
    events = _Events(monkeypatch)
    resumed = panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, progress=False,
                                               resume=True, **options)
    assert [part for event, part in events.log if event == "load"] == [None, 2, None]  # only what was left
    assert _tree(tmp_path / "out") == {name: digest for name, digest in _tree(tmp_path / "whole").items()
                                       if name != "report.png"} | {"report.png": _tree(tmp_path / "out")["report.png"]}
    assert resumed.attrs["summary"] == whole.attrs["summary"] and resumed.equals(whole)
    assert resumed.attrs.get("refinement") == whole.attrs.get("refinement") and _tree(model_dir) == before


def test_each_blocks_fisher_is_kept_on_disk_until_the_block_is_written(saved, tmp_path, monkeypatch):
    listed, commit = [], RunState.commit

    def listing(state, count, record, streams, outside=False):
        commit(state, count, record, streams, outside)
        listed.append((count, sorted(path.name for path in state.scratch("").glob("*") if "output-fisher" in path.name
                                     or "block-outputs" in path.name)))

    monkeypatch.setattr(RunState, "commit", listing)
    panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(), param_ratio=0.5,
                                     output_fisher=True, progress=False)
    kept = ["output-fisher-done.pt", "output-fisher-outside.pt"]
    assert listed[:3] == [(count, sorted(kept + [f"output-fisher-{i}.pt" for i in range(count - 1, 3)]))
                          for count in (1, 2, 3)]  # no block's outputs left; a block's Fisher gone once it is written


_KILLED = """
import os, signal, sys, torch
import panther_lite
from panther_lite.conversion.saving.resume_state import RunState
commit = RunState.commit
def commit_then_die(state, count, *args, **kwargs):
    commit(state, count, *args, **kwargs)
    if count == 1:
        os.kill(os.getpid(), signal.SIGKILL)
RunState.commit = commit_then_die
torch.set_num_threads(1)
batches = torch.load(sys.argv[3])
panther_lite.compress_checkpoint(sys.argv[1], sys.argv[2], calibration_data=batches, param_ratio=0.5, progress=False)
"""


def test_a_run_killed_with_sigkill_resumes_as_if_never_stopped(saved, tmp_path):
    batches, data = _batches(), tmp_path / "batches.pt"
    torch.save(batches, data)
    output = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(saved["gpt2"]), str(output), str(data)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not output.exists() and (tmp_path / ".out.partial").is_dir()
    panther_lite.compress_checkpoint(saved["gpt2"], output, calibration_data=batches, param_ratio=0.5, progress=False,
                                     resume=True)
    panther_lite.compress_checkpoint(saved["gpt2"], tmp_path / "whole", calibration_data=batches, param_ratio=0.5,
                                     progress=False)
    shards = sorted(path.name for path in output.glob("*.safetensors"))
    assert len(shards) == 4 and all((output / n).read_bytes() == (tmp_path / "whole" / n).read_bytes() for n in shards)


def test_a_staging_directory_of_another_run_is_refused_and_kept(saved, tmp_path, monkeypatch):
    batches, output = _batches(), tmp_path / "out"
    with monkeypatch.context() as patch:
        _stop_after(patch, 1)
        with pytest.raises(_Stop):
            panther_lite.compress_checkpoint(saved["llama"], output, calibration_data=batches, param_ratio=0.5,
                                             progress=False)
    kept = _tree(tmp_path / ".out.partial")
    other = _save("llama", tmp_path / "other", seed=1)  # same architecture, same header, other weights
    for model_dir, data, options, words in [
        (saved["llama"], batches, dict(param_ratio=0.4), "other options (param_ratio: 0.5 then, 0.4 now)"),
        (saved["llama"], batches, dict(param_ratio=0.5, allocation="global"), "other options (allocation: 'uniform' then"),
        (other, batches, dict(param_ratio=0.5), "another checkpoint"),
        (saved["llama"], _batches(seed=2), dict(param_ratio=0.5), "other calibration data"),
    ]:
        with pytest.raises(ValueError, match=f"cannot resume from .*made from {words}".replace("(", r"\(")
                           .replace(")", r"\)")):
            panther_lite.compress_checkpoint(model_dir, output, calibration_data=data, resume=True, progress=False,
                                             **options)
        assert _tree(tmp_path / ".out.partial") == kept
    panther_lite.compress_checkpoint(saved["llama"], output, calibration_data=batches, param_ratio=0.5,
                                     progress=False, resume=True)
    assert sorted(os.listdir(tmp_path)) == ["other", "out"]


def test_one_staging_directory_serves_one_run_at_a_time(tmp_path):
    fingerprint = dict(checkpoint="c", options={}, data="d", versions={})
    first = RunState(tmp_path, fingerprint)
    with pytest.raises(ValueError, match="is in use by another run"):
        RunState(tmp_path, fingerprint)
    first.close()
    RunState(tmp_path, fingerprint).close()


def test_nothing_is_written_into_model_dir_and_an_output_inside_it_is_refused(saved, tmp_path):
    model_dir = shutil.copytree(saved["llama"], tmp_path / "model")
    before = _tree(model_dir)
    for output in (model_dir, model_dir / "out", tmp_path):
        with pytest.raises(ValueError, match="MODEL_DIR"):
            panther_lite.compress_checkpoint(model_dir, output, calibration_data=_batches(), param_ratio=0.5,
                                             overwrite=True)
    assert _tree(model_dir) == before and sorted(os.listdir(tmp_path)) == ["model"]


def test_options_are_checked_before_anything_is_read_or_written(saved, tmp_path):
    with pytest.raises(TypeError, match="unknown option 'param_ration'.*did you mean 'param_ratio'"):
        panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(),
                                         param_ration=0.5)
    with pytest.raises(TypeError, match="dtype must be None"):
        panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(),
                                         param_ratio=0.5, dtype="bfloat16")
    with pytest.raises(TypeError, match="distill must be None or a callable"):
        panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(),
                                         param_ratio=0.5, distill={"max_steps": 2})
    assert os.listdir(tmp_path) == []


def _distill_step(seen: dict, fail: bool = False):
    """A ``distill=`` step recording what it gets and moving one factor by 1 (or failing)."""
    def step(model, directory):
        if fail:
            raise KeyboardInterrupt
        layer = next(m for m in model.modules() if isinstance(m, SKLinear))
        dense = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"]
        seen.update(sketched=True, staged=directory.name.startswith("."), dense=dense)
        with torch.no_grad():
            layer.S1.add_(1.0)
        (directory / "step.txt").write_text("ran")

    return step


def test_distill_streams_the_conversion_then_trains_the_reloaded_compressed_model(saved, tmp_path, monkeypatch):
    """``distill=`` gets the converted model loaded back from the streamed conversion (at its compressed
    size: never the original whole, no copy of it) before the model is written; its changes are saved."""
    whole, seen = [], {}
    real_load_whole = CheckpointFiles.load_whole
    monkeypatch.setattr(CheckpointFiles, "load_whole", lambda self, *a: whole.append(1) or real_load_whole(self, *a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "loading whole" warning: nothing is
        report = panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=_batches(),
                                                  param_ratio=0.5, distill=_distill_step(seen), progress=False)
    assert whole == [] and report.attrs["pipeline"].startswith("out of core")
    assert seen["sketched"] and seen["staged"] and seen["dense"] == []
    assert (tmp_path / "out" / "step.txt").read_text() == "ran"
    plain = panther_lite.compress_checkpoint(saved["llama"], tmp_path / "plain", calibration_data=_batches(),
                                             param_ratio=0.5, progress=False)
    distilled = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "out")
    converted = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "plain")
    assert plain.attrs["summary"] == report.attrs["summary"]
    changed = {name for name, value in distilled.state_dict().items()
               if not torch.equal(value, converted.state_dict()[name])}
    assert len(changed) == 1 and changed.pop().endswith(".S1")  # the step's change, saved; nothing else
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "out" / ".panther_lite_resume").exists()


def test_a_run_stopped_while_distilling_resumes_with_the_distillation_alone(saved, tmp_path):
    output, seen = tmp_path / "out", {}
    options = dict(calibration_data=_batches(), param_ratio=0.5, progress=False)
    with pytest.raises(KeyboardInterrupt):
        panther_lite.compress_checkpoint(saved["llama"], output, distill=_distill_step(seen, fail=True), **options)
    assert not output.exists()
    panther_lite.compress_checkpoint(saved["llama"], output, resume=True, distill=_distill_step(seen), **options)
    assert seen["sketched"] and (output / "step.txt").read_text() == "ran"
    expected = _distill_step({})
    model, _ = _in_memory(saved["llama"], _batches(), param_ratio=0.5)
    expected(model, tmp_path)
    assert _relative_logit_error(saved["llama"], output, model, _batches()) <= 1e-4


@pytest.mark.cuda
def test_with_calibration_on_the_gpu_each_block_visits_it_and_the_model_is_the_same(saved, tmp_path):
    batches = _batches()
    options = dict(param_ratio=0.5, calibration_device="cuda", allocation="global", sequential=True)
    torch.cuda.reset_peak_memory_stats()
    panther_lite.compress_checkpoint(saved["llama"], tmp_path / "out", calibration_data=batches, progress=False,
                                     **options)
    expected, _ = _in_memory(saved["llama"], batches, **options)
    assert _relative_logit_error(saved["llama"], tmp_path / "out", expected, batches) <= 1e-4
    assert torch.cuda.max_memory_allocated() > 0 and torch.cuda.memory_allocated() < 1 << 20  # nothing left there
