"""``python -m panther_lite compress``: end to end on tiny transformers checkpoints saved to
disk (GPT-2, LLaMA, BERT), streamed block by block, the reloaded model against one converted
in-process, and every kind of bad input ending in one message, a non-zero exit and nothing
written (the resumable runs are tests/conversion/workflows/test_compress.py's and
tests/cli/test_compress_safety.py's)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.cli import compress as compress_module  # noqa: E402
from panther_lite.cli import distilling as distilling_module  # noqa: E402
from panther_lite.cli import main  # noqa: E402
from panther_lite.conversion.distilling import distillation as distillation_module  # noqa: E402
from panther_lite.conversion.distilling import memory as memory_module  # noqa: E402
from panther_lite.conversion.distilling import sampled_batches  # noqa: E402
from panther_lite.conversion.pipelines import out_of_core  # noqa: E402
from panther_lite.conversion.fitting import autocast as autocast_module  # noqa: E402
from panther_lite.conversion.fitting.autocast import check_autocast  # noqa: E402
from panther_lite.conversion.workflows import compress as compress_library  # noqa: E402
from panther_lite.cli.checkpoint import calibration_batches, read_samples  # noqa: E402
from panther_lite.conversion.saving.checkpoint_files import CheckpointFiles, auto_class_for  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RATIO_ARGS = ["--param-ratio", "0.5", "--fit", "exact", "--quiet"]
MODELS = ["gpt2", "llama", "bert"]  # the tiny checkpoints of the ``checkpoints`` fixture (tests/conftest.py)
AUTO_CLASSES = {"gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM"}


pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


def _argv(model_dir, text_file, output, *extra):
    return ["compress", str(model_dir), "--calibration", str(text_file), "--output", str(output), *extra]


def _leftovers(parent: Path, output: Path) -> list:
    """Anything the command left beside OUT_DIR (staging directories, half-written files)."""
    return sorted(path.name for path in parent.iterdir() if path.name != output.name)


def _converted_in_process(model_dir: Path, text_file: Path, **options):
    """The checkpoint converted by panther_lite.convert with the command's default batches."""
    auto = getattr(transformers, AUTO_CLASSES[model_dir.name])
    model = auto.from_pretrained(str(model_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    batches = calibration_batches(read_samples(text_file, 128), tokenizer, model, 256, 8)
    report = panther_lite.convert(model, calibration_data=batches, progress=False, **options)
    return model, batches, report


@pytest.mark.parametrize("name", MODELS)
def test_compress_writes_a_model_that_from_pretrained_reloads_as_convert_made_it(
    name, checkpoints, text_file, tmp_path, capsys, word_tokenizer
):
    output = tmp_path / "out"
    assert main(_argv(checkpoints[name], text_file, output, *RATIO_ARGS)) == 0
    expected, batches, report = _converted_in_process(checkpoints[name], text_file, param_ratio=0.5, decomposition="exact")
    assert capsys.readouterr().out.strip() == report.attrs["summary"]
    assert {"config.json", "model.safetensors.index.json", "panther_lite_config.json", "tokenizer.json", "report.csv",
            "report.png", "model-00003-of-00003.safetensors"} <= {path.name for path in output.iterdir()}  # streamed
    assert _leftovers(tmp_path, output) == []

    reloaded = panther_lite.from_pretrained(getattr(transformers, AUTO_CLASSES[name]), output).eval()
    sketched = sum(isinstance(module, SKLinear) for module in reloaded.modules())
    assert sketched == (report["status"] == "converted").sum() > 0
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(reloaded(**batch).logits, expected(**batch).logits, rtol=1e-5, atol=1e-5)
    written = pd.read_csv(output / "report.csv")
    assert list(written["name"]) == list(report["name"])
    assert list(written["low_rank"].fillna(0)) == list(report["low_rank"].fillna(0))
    assert transformers.AutoTokenizer.from_pretrained(str(output)).get_vocab() == word_tokenizer().get_vocab()


def test_python_dash_m_runs_global_sequential_and_replaces_with_overwrite(checkpoints, text_file, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "stale.txt").write_text("from an earlier run")
    argv = _argv(checkpoints["llama"], text_file, output, "--param-ratio", "0.5", "--allocation", "global",
                 "--sequential", "--seed", "0", "--overwrite", "--max-samples", "12", "--seq-len", "8")
    result = subprocess.run([sys.executable, "-m", "panther_lite", *argv], capture_output=True, text=True,
                            cwd=ROOT, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("converted ") and "Traceback" not in result.stderr
    assert "torchao" not in result.stderr and "_pytree" not in result.stderr  # optional packages' load notes
    assert "from_pretrained(AutoModelForCausalLM" in result.stderr
    assert not (output / "stale.txt").exists() and (output / "report.png").stat().st_size > 0
    assert _leftovers(tmp_path, output) == []
    reloaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)
    assert any(isinstance(module, SKLinear) for module in reloaded.modules())


def test_refine_writes_each_blocks_errors_beside_the_model(checkpoints, text_file, tmp_path, capsys):
    output = tmp_path / "out"
    argv = _argv(checkpoints["llama"], text_file, output, "--param-ratio", "0.5", "--refine", "--refine-steps", "3")
    assert main(argv) == 0
    assert "refined 2 blocks: mean held-back block output error" in capsys.readouterr().err
    rows = pd.read_csv(output / "refinement.csv")
    assert list(rows["name"]) == ["model.layers.0", "model.layers.1"]
    assert (rows["error_after"] <= rows["error_before"]).all() and (rows["steps"] <= 3).all()
    reloaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output)
    assert any(isinstance(module, SKLinear) for module in reloaded.modules())


def test_distill_trains_the_streamed_conversion_against_the_cached_original_as_distill_does(
    checkpoints, text_file, tmp_path, capsys, monkeypatch
):
    whole = []
    real_load_whole = CheckpointFiles.load_whole
    monkeypatch.setattr(CheckpointFiles, "load_whole", lambda self, *a: whole.append(self) or real_load_whole(self, *a))
    output = tmp_path / "out"
    loud = RATIO_ARGS[:-1]  # the step messages
    assert main(_argv(checkpoints["llama"], text_file, output, *loud, "--distill", "--distill-steps", "4")) == 0
    err = capsys.readouterr().err
    assert whole == []  # the original is never loaded whole: cached streamed, converted streamed
    assert "cached the original's outputs on 3 batches" in err and "(out of core:" in err
    assert "distilled 4 steps (max_steps; kept step" in err
    history = pd.read_csv(output / "distillation.csv")
    assert list(history.columns) == ["step", "train_loss", "held_loss"] and history["step"].iloc[-1] == 4
    assert history["held_loss"].min() < history["held_loss"].iloc[0]

    teacher = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])).eval()
    expected, batches, _ = _converted_in_process(checkpoints["llama"], text_file, param_ratio=0.5, decomposition="exact")
    cached = panther_lite.teacher_outputs(teacher, batches, progress=False)  # top 64: the whole vocabulary here
    result = panther_lite.distill(expected, cached, batches, max_steps=4, progress=False)
    assert history["held_loss"].tolist() == pytest.approx([h for _, _, h in result.history], rel=1e-5)
    reloaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output).eval()
    assert {"config.json", "model.safetensors", "tokenizer.json", "report.csv"} <= {p.name for p in output.iterdir()}
    with torch.no_grad():
        for batch in batches:
            torch.testing.assert_close(reloaded(**batch).logits, expected(**batch).logits, rtol=1e-4, atol=1e-5)
    assert _leftovers(tmp_path, output) == []


def test_distill_caches_its_own_random_tokens_and_top_k_beside_the_text_batches(
    checkpoints, text_file, tmp_path, monkeypatch
):
    seen = {}
    real_distill = distilling_module.distill
    monkeypatch.setattr(distilling_module, "distill", lambda model, cached, data, config: seen.update(
        data=data, cached=cached, config=config) or real_distill(model, cached, data, config))
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, "--random-tokens", "12",
                 "--distill", "--distill-steps", "2", "--distill-lr", "0.01", "--distill-top-k", "8",
                 "--distill-train", "factors,norms", "--distill-autocast", "bfloat16", "--distill-max-minutes", "90")
    assert main(argv) == 0
    assert sum(batch["input_ids"].shape[0] for batch in seen["data"]) == len(read_samples(text_file, 128))
    config, cached = seen["config"], seen["cached"]
    assert config.random_tokens == 12 and config.tokenizer is not None
    assert (config.max_steps, config.lr, config.top_k, config.train) == (2, 0.01, 8, ("factors", "norms"))
    assert config.max_minutes == 90.0
    assert config.autocast == torch.bfloat16
    assert len(cached.random_batches) == 1 and cached.random_batches[0]["input_ids"].shape[0] == 12
    assert all(target.indices.shape[-1] == 8 for target in cached.targets)


def _spy(monkeypatch, calls: list, stop: bool = False):
    """Record the arguments compress_checkpoint receives (and stop there, with ``stop``)."""
    real = compress_module.compress_checkpoint

    def spy(model_dir, output_dir, **options):
        calls.append(options)
        if stop:
            raise ValueError("stop after the options")
        return real(model_dir, output_dir, **options)

    monkeypatch.setattr(compress_module, "compress_checkpoint", spy)


def test_random_tokens_join_the_calibration_batches(checkpoints, text_file, tmp_path, capsys, monkeypatch):
    seen = []
    _spy(monkeypatch, seen)
    argv = _argv(checkpoints["bert"], text_file, tmp_path / "out", "--param-ratio", "0.5", "--random-tokens", "12")
    assert main(argv) == 0
    assert "samples and 12 random-token sequences" in capsys.readouterr().err
    rows = [batch["input_ids"].shape for batch in seen[0]["calibration_data"]]
    assert sum(shape[0] for shape in rows) == len(read_samples(text_file, 128)) + 12
    assert rows[-2:] == [(8, 16), (4, 16)]  # 16 random tokens each, in --batch-size batches


@pytest.mark.parametrize("case", ["count beyond memory", "rows longer than the positions"])
def test_random_tokens_the_model_or_machine_cannot_take_name_the_option(
    case, checkpoints, text_file, tmp_path, capsys, save_checkpoint, word_tokenizer
):
    if case == "count beyond memory":
        model_dir, count, words = checkpoints["bert"], 10**12, "--random-tokens 1000000000000: count="
    else:
        config = transformers.BertConfig(vocab_size=len(word_tokenizer()), hidden_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=8, max_position_embeddings=12)
        model_dir = save_checkpoint(transformers.BertForMaskedLM(config), tmp_path / "short")
        count, words = 4, "--random-tokens 4: length=16: rows of 16 random tokens"
    argv = _argv(model_dir, text_file, tmp_path / "out", *RATIO_ARGS, "--random-tokens", str(count))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), err


def _no_linear_checkpoint(directory: Path, save_checkpoint, vocab: int) -> Path:
    """A registered transformers model made of an embedding alone."""

    class NoLinearConfig(transformers.PreTrainedConfig):
        model_type = "panther-lite-test-no-linear"

    class NoLinearModel(transformers.PreTrainedModel):
        config_class = NoLinearConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(vocab, 4)
            self.post_init()

        def forward(self, input_ids, attention_mask=None):
            return self.embed(input_ids)

    transformers.AutoConfig.register(NoLinearConfig.model_type, NoLinearConfig, exist_ok=True)
    transformers.AutoModel.register(NoLinearConfig, NoLinearModel, exist_ok=True)
    return save_checkpoint(NoLinearModel(NoLinearConfig(vocab_size=vocab)), directory)


def _bad_inputs(checkpoints, text_file, tmp_path, save_checkpoint, vocab):
    """``{case: (argv, exit status, words the message must contain)}``."""
    gpt2, out = checkpoints["gpt2"], tmp_path / "out"
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    no_tokenizer, no_weights = tmp_path / "no_tokenizer", tmp_path / "no_weights"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((gpt2 / "config.json").read_text())
    shutil.copytree(gpt2, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    empty_text = tmp_path / "empty.txt"
    empty_text.write_text("\n  \n\n")
    return {
        "missing model dir": (_argv(tmp_path / "absent", text_file, out, *RATIO_ARGS), 1, "does not exist"),
        "not a model dir": (_argv(not_a_model, text_file, out, *RATIO_ARGS), 1, "no config.json"),
        "no tokenizer": (_argv(no_tokenizer, text_file, out, *RATIO_ARGS), 1, "no usable tokenizer"),
        "no weights": (_argv(no_weights, text_file, out, *RATIO_ARGS), 1, "has no weights"),
        "missing calibration": (_argv(gpt2, tmp_path / "absent.txt", out, *RATIO_ARGS), 1, "does not exist"),
        "empty calibration": (_argv(gpt2, empty_text, out, *RATIO_ARGS), 1, "has no text"),
        "unknown allocation": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--allocation", "best"), 2, "invalid choice"),
        "ratio above one": (_argv(gpt2, text_file, out, "--param-ratio", "1.5"), 2, "(0, 1]"),
        "ratio not a number": (_argv(gpt2, text_file, out, "--param-ratio", "half"), 2, "(0, 1]"),
        "no size": (_argv(gpt2, text_file, out, "--quiet"), 1, "--param-ratio"),
        "no linear layers": (
            _argv(_no_linear_checkpoint(tmp_path / "no_linear", save_checkpoint, vocab), text_file, out, *RATIO_ARGS), 1,
            "candidates are: none",
        ),
        "unmatched target": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--target-modules", "q_proj"), 1, "q_proj"),
        "output inside model dir": (_argv(gpt2, text_file, gpt2 / "out", *RATIO_ARGS), 1, "MODEL_DIR"),
        "refine settings without refine": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--refine-steps", "5"), 1, "add --refine"),
        "refine lr not positive": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--refine", "--refine-lr", "0"), 2,
                                   "a finite number > 0"),
        "calibration device absent": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--calibration-device", "cuda:99"), 2,
                                      "argument --calibration-device: 'cuda:99'"),
        "calibration device not a device": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--calibration-device", "gpu"), 2,
                                            "expected a torch device"),
        "refine without blocks": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--refine", "--blocks", "off"), 1,
                                  "cannot be combined with --blocks off"),
        "distill settings without distill": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--distill-steps", "5"), 1,
                                             "add --distill"),
        "distill lr not positive": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--distill", "--distill-lr", "0"), 2,
                                    "a finite number > 0"),
        "distill minutes not positive": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--distill", "--distill-max-minutes",
                                               "0"), 2, "a finite number > 0"),
        "distill train unknown": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--distill", "--distill-train", "factors,weights"),
                                  2, "expected one or more of factors,biases,norms, comma-separated, got 'factors,weights'"),
        "distill autocast unknown": (_argv(gpt2, text_file, out, *RATIO_ARGS, "--distill", "--distill-autocast", "int8"),
                                     2, "invalid choice: 'int8'"),
    }


CASES = [
    "missing model dir", "not a model dir", "no tokenizer", "no weights", "missing calibration", "empty calibration",
    "unknown allocation", "ratio above one", "ratio not a number", "no size", "no linear layers",
    "unmatched target", "output inside model dir", "refine settings without refine", "refine lr not positive",
    "refine without blocks", "calibration device absent", "calibration device not a device",
    "distill settings without distill", "distill lr not positive", "distill minutes not positive",
    "distill train unknown",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_ends_in_one_message_and_writes_nothing(
    case, checkpoints, text_file, tmp_path, capsys, save_checkpoint, word_tokenizer
):
    argv, status, words = _bad_inputs(checkpoints, text_file, tmp_path, save_checkpoint, len(word_tokenizer()))[case]
    before = sorted(path.name for path in tmp_path.iterdir())
    assert main(argv) == status
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    if status == 1:
        assert len(err.strip().splitlines()) == 1 and err.startswith("python -m panther_lite compress: error: "), err
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_calibration_device_cuda_without_cuda_is_a_usage_error(checkpoints, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = _argv(checkpoints["gpt2"], text_file, tmp_path / "out", *RATIO_ARGS, "--calibration-device", "cuda")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "python -m panther_lite compress: error: argument --calibration-device: 'cuda': cuda is not available on "
        "this machine"
    ) and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_non_empty_output_is_refused_without_overwrite(checkpoints, text_file, tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert main(_argv(checkpoints["gpt2"], text_file, output, *RATIO_ARGS)) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert [path.name for path in output.iterdir()] == ["keep.txt"] and _leftovers(tmp_path, output) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_failure_or_ctrl_c_before_any_block_is_written_leaves_nothing(failure, checkpoints, text_file, tmp_path,
                                                                       capsys, monkeypatch):
    output = tmp_path / "new" / "out"

    def fail(*args, **kwargs):
        raise failure("stopped before the first block")

    monkeypatch.setattr(out_of_core.OutOfCore, "capture", fail)
    status = main(_argv(checkpoints["gpt2"], text_file, output, *RATIO_ARGS))
    assert status == (130 if failure is KeyboardInterrupt else 1)
    assert "Traceback" not in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither OUT_DIR, nor its staging, nor the parent made for it


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_failure_or_ctrl_c_while_saving_keeps_the_blocks_for_resume(failure, checkpoints, text_file, tmp_path, capsys,
                                                                     monkeypatch):
    output = tmp_path / "new" / "out"
    argv = _argv(checkpoints["gpt2"], text_file, output, *RATIO_ARGS)

    def fail(*args, **kwargs):
        raise failure("stopped while saving")

    with monkeypatch.context() as patch:
        patch.setattr(compress_library, "save_transformers_config", fail)
        assert main(argv) == (130 if failure is KeyboardInterrupt else 1)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "run the same command with --resume" in err
    assert not output.exists() and [path.name for path in output.parent.iterdir()] == [".out.partial"]
    assert main(argv) == 1 and "holds an unfinished run" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    assert (output / "panther_lite_config.json").is_file() and list(output.parent.iterdir()) == [output]


def test_blocks_reaches_compress_in_the_config(text_file, tmp_path, checkpoints, monkeypatch):
    received = []
    _spy(monkeypatch, received, stop=True)
    argv = _argv(checkpoints["gpt2"], text_file, tmp_path / "out", *RATIO_ARGS, "--blocks", "transformer.h")
    assert main(argv) == 1 and received[-1]["config"].blocks == "transformer.h"
    assert main(argv[:-1] + ["off"]) == 1 and received[-1]["config"].blocks is False
    assert list(tmp_path.iterdir()) == []


def test_without_blocks_the_model_is_loaded_whole_and_the_command_says_why(checkpoints, text_file, tmp_path, capsys):
    output = tmp_path / "out"
    assert main(_argv(checkpoints["llama"], text_file, output, *RATIO_ARGS[:-1], "--blocks", "off")) == 0
    err = capsys.readouterr().err
    assert "warning: compress_checkpoint: loading" in err and "whole: blocks=False" in err
    assert (output / "model.safetensors").is_file() and not (output / "model.safetensors.index.json").exists()
    assert main(_argv(checkpoints["llama"], text_file, output, *RATIO_ARGS[:-1], "--in-memory", "--overwrite")) == 0
    assert "block pipeline: 2 blocks at model.layers (the model loaded whole: in_memory=True)" in capsys.readouterr().err


def test_calibration_batches_skip_blanks_truncate_pad_and_leave_the_tokenizer_alone(text_file, checkpoints):
    samples = read_samples(text_file, max_samples=10)
    assert len(samples) == 10 and all(samples)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoints["gpt2"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["gpt2"]))
    batches = calibration_batches(samples, tokenizer, model, seq_len=6, batch_size=4)
    assert [len(batch["input_ids"]) for batch in batches] == [4, 4, 2]
    lengths = [min(len(text.split()), 6) for text in samples]
    assert sorted(int(n) for batch in batches for n in batch["attention_mask"].sum(1)) == sorted(lengths)
    for batch in batches:
        real = batch["attention_mask"].bool()
        assert batch["input_ids"].shape[1] <= 6 and (batch["input_ids"][~real] == tokenizer.pad_token_id).all()
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token is None


def test_auto_class_follows_the_saved_architecture():
    gpt2 = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    assert auto_class_for(gpt2) is transformers.AutoModelForCausalLM
    assert auto_class_for(transformers.BertConfig(architectures=["BertModel"])) is transformers.AutoModel
    assert auto_class_for(transformers.BertConfig()) is transformers.AutoModel


def test_fewer_calibration_tokens_than_a_layer_has_inputs_warns(checkpoints, text_file, tmp_path, monkeypatch, capsys):
    _spy(monkeypatch, [], stop=True)
    few = ["--max-samples", "2", "--seq-len", "4"]
    main(_argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, *few))
    assert "fewer than the 64 inputs of model.layers.0.mlp.down_proj" in capsys.readouterr().err
    main(_argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS))
    assert "warning" not in capsys.readouterr().err


def test_distill_generate_trains_on_sequences_the_streamed_original_samples_after_the_text(
    checkpoints, text_file, tmp_path, monkeypatch
):
    seen = {}
    real_distill = distilling_module.distill
    monkeypatch.setattr(distilling_module, "distill", lambda model, cached, data, config: seen.update(
        data=data, cached=cached) or real_distill(model, cached, data, config))
    real_cache = distilling_module.teacher_outputs
    monkeypatch.setattr(distilling_module, "teacher_outputs", lambda *args, known, **kwargs: seen.update(
        known=known) or real_cache(*args, known=known, **kwargs))
    real_check, real_streamed = compress_module.check_distill_memory, distilling_module.streamed_model
    monkeypatch.setattr(compress_module, "check_distill_memory", lambda *args: seen.setdefault(
        "floor", real_check(*args)))
    monkeypatch.setattr(distilling_module, "streamed_model", lambda *args, resident_bytes: (seen.setdefault(
        "resident", resident_bytes), real_streamed(*args, resident_bytes=resident_bytes))[1])
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, "--distill", "--distill-steps", "2",
                 "--distill-generate", "5")
    assert main(argv) == 0
    assert seen["resident"] == seen["floor"] > 0  # the sampling may hold what the distillation will
    teacher = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoints["llama"]))
    batches = calibration_batches(read_samples(text_file, 128), tokenizer, teacher, 256, 8)
    width = max(batch["input_ids"].shape[1] for batch in batches)  # 12 tokens: half of them continued
    expected = sampled_batches(teacher, batches, 5, width, prefix=width // 2, batch_size=8, progress=False)
    assert len(seen["data"]) == len(batches) + len(expected) == len(seen["cached"])
    for got, want in zip(seen["data"][len(batches):], expected):  # the streamed teacher samples as the whole one
        assert torch.equal(got["input_ids"], want["input_ids"]) and bool(got["attention_mask"].all())
    assert seen["known"][:len(batches)] == [None] * len(batches)  # the text's outputs: one forward each
    reference = panther_lite.teacher_outputs(teacher, expected, top_k=64, progress=False).targets
    for index, want in enumerate(reference, start=len(batches)):  # the sampled ones: kept while sampling
        kept = seen["cached"].targets[index]
        assert kept is seen["known"][index]
        torch.testing.assert_close(kept.log_probs, want.log_probs, rtol=0, atol=1e-4)



def test_calibrate_generated_lets_the_first_sampled_sequences_calibrate_the_conversion_too(
    checkpoints, text_file, tmp_path, monkeypatch, capsys
):
    """The conversion is calibrated on the text, then the first N sequences the distillation trains on
    (the very tensors, cut to N rows); asking for more than are sampled takes them all."""
    seen, calls = {}, []
    real_distill = distilling_module.distill
    monkeypatch.setattr(distilling_module, "distill", lambda model, cached, data, config: seen.update(
        data=data) or real_distill(model, cached, data, config))
    _spy(monkeypatch, calls)
    loud = [arg for arg in RATIO_ARGS if arg != "--quiet"]
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *loud, "--distill", "--distill-steps", "1",
                 "--distill-generate", "11", "--batch-size", "4")
    assert main([*argv, "--calibrate-generated", "6"]) == 0
    assert "the first 6 of them also calibrate the conversion" in capsys.readouterr().err
    text = len(seen["data"]) - 3  # 11 sequences in batches of 4
    calibration = calls[0]["calibration_data"]
    assert [batch["input_ids"].shape[0] for batch in calibration[text:]] == [4, 2]
    assert all(got is want for got, want in zip(calibration[:text], seen["data"][:text]))
    sampled = torch.cat([batch["input_ids"] for batch in seen["data"][text:]])
    assert torch.equal(torch.cat([batch["input_ids"] for batch in calibration[text:]]), sampled[:6])
    assert main([*argv, "--calibrate-generated", "40", "--overwrite"]) == 0
    assert torch.equal(torch.cat([batch["input_ids"] for batch in calls[1]["calibration_data"][text:]]), sampled)
    assert main([*argv, "--overwrite"]) == 0  # without it, the text alone
    assert len(calls[2]["calibration_data"]) == text


@pytest.mark.parametrize("extra, message", [
    (["--calibrate-generated", "4"], "add --distill"),
    (["--distill", "--calibrate-generated", "4"], "--calibrate-generated 4 takes the first of the sequences --distill-generate"),
])
def test_calibrate_generated_without_what_it_takes_is_refused_before_anything_is_written(
    checkpoints, text_file, tmp_path, capsys, extra, message
):
    assert main(_argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, *extra)) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_original_samples_in_bfloat16_when_the_student_trains_in_it(checkpoints, text_file, tmp_path, monkeypatch):
    seen = []
    real_sampled = distilling_module.sampled_batches
    monkeypatch.setattr(distilling_module, "sampled_batches", lambda teacher, *args, **kwargs: (
        seen.append(next(teacher.parameters()).dtype), real_sampled(teacher, *args, **kwargs))[1])
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, "--distill", "--distill-steps", "1",
                 "--distill-generate", "3", "--distill-autocast", "bfloat16")
    assert main(argv) == 0
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("autocast, native, checkpoint, sampled_in", [
    (None, True, None, None), (None, True, torch.float16, torch.float16), ("bfloat16", False, None, torch.bfloat16),
    ("auto", True, None, torch.bfloat16), ("auto", False, None, None),
    ("float16", True, None, None),  # float16 on a CPU: not native, and too narrow for some activations
])
def test_the_sampling_dtype_follows_a_bfloat16_autocast_only(monkeypatch, autocast, native, checkpoint, sampled_in):
    monkeypatch.setattr(autocast_module, "native_bfloat16", lambda device: native)
    assert distilling_module.sampling_dtype(check_autocast(autocast, "test"), checkpoint) == sampled_in

def _memory_checks(monkeypatch, *modules):
    """The ``(caller, elements, trained)`` each memory check in ``modules`` is asked about, recorded."""
    seen = []
    for module in modules:
        real = module.check_training_memory
        monkeypatch.setattr(module, "check_training_memory", lambda elements, trained, caller, remedy, real=real: (
            seen.append((caller, elements, trained)), real(elements, trained, caller, remedy)))
    return seen


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_distill_memory_is_estimated_before_the_conversion_from_below_the_model_distill_trains(
    checkpoints, text_file, tmp_path, monkeypatch, allocation
):
    seen = _memory_checks(monkeypatch, distilling_module, distillation_module)
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, "--allocation", allocation,
                 "--distill", "--distill-steps", "1")
    assert main(argv) == 0
    (before, estimate, none_trained), (during, exact, trained) = seen
    assert (before, during, none_trained) == ("--distill", "distill", 0) and trained > 0
    assert 0.8 * exact <= estimate <= exact  # a close estimate, never above what distill holds


def test_distill_beyond_this_machines_memory_is_refused_before_the_conversion_starts(
    checkpoints, text_file, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(memory_module, "physical_memory", lambda: 2**10)
    real_calibration, real_compress = compress_module._calibration, compress_module.compress_checkpoint
    monkeypatch.setattr(compress_module, "compress_checkpoint", lambda *a, **k: pytest.fail("converted"))
    monkeypatch.setattr(compress_module, "_calibration", lambda *a: pytest.fail("read the calibration"))
    argv = _argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS, "--distill")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--distill: training this model needs at least" in err and "this machine's 1.0 KiB of memory" in err
    assert "leave --distill out (--no-distill after --recipe)" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    monkeypatch.setattr(compress_module, "_calibration", real_calibration)
    monkeypatch.setattr(compress_module, "compress_checkpoint", real_compress)
    assert main(_argv(checkpoints["llama"], text_file, tmp_path / "out", *RATIO_ARGS)) == 0  # without --distill: runs


def test_distill_refused_after_the_conversion_keeps_it_and_a_resume_without_distill_finishes(
    checkpoints, text_file, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(distilling_module, "check_training_memory", lambda *a: None)  # the estimate let it through
    monkeypatch.setattr(memory_module, "physical_memory", lambda: 2**10)  # distill's exact count does not
    output = tmp_path / "out"
    argv = _argv(checkpoints["llama"], text_file, output, *RATIO_ARGS, "--distill")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "distill: training this model needs at least" in err and "with --resume to continue" in err
    assert not output.exists()
    monkeypatch.undo()
    assert main([*argv, "--no-distill", "--resume"]) == 0
    assert main(_argv(checkpoints["llama"], text_file, tmp_path / "direct", *RATIO_ARGS)) == 0
    resumed, direct = (panther_lite.from_pretrained(transformers.AutoModelForCausalLM, path).eval()
                       for path in (output, tmp_path / "direct"))
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert _leftovers(tmp_path, output) == ["direct"]


def test_distill_generate_refuses_one_token_samples_and_leaves_out_dir_unwritten(checkpoints, tmp_path, capsys):
    words = tmp_path / "words.txt"
    words.write_text("\n".join(["alpha", "beta", "gamma"] * 4))
    assert main(_argv(checkpoints["llama"], words, tmp_path / "out", *RATIO_ARGS, "--distill", "--distill-generate", "2")) == 1
    assert "the calibration samples hold one token each" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
