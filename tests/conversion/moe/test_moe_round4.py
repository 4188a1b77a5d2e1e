"""Mixture-of-experts models through the ``compress`` command and ``save_pretrained`` after a
global allocation (issue 39): tiny random-init Mixtral, Qwen2-MoE (with its shared expert) and
OLMoE save and reload with the converted model's outputs, the command compresses them streamed
and in memory, and a command error is never printed empty."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

import panther_lite  # noqa: E402
from panther_lite.cli import main  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*gradient_checkpointing")]


def _reloaded_error(model, directory: Path, batches) -> float:
    loaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, directory).eval()
    loaded.set_experts_implementation("eager")
    with torch.no_grad():
        pairs = [(loaded(ids).logits, model(ids).logits) for ids in batches]
    return max(float((got - want).norm() / want.norm()) for got, want in pairs)


@pytest.mark.parametrize("name,options", [
    ("mixtral", dict(allocation="global")),
    ("qwen2_moe", dict(allocation="global")),
    ("qwen2_moe", dict(allocation="global", sequential=True)),
    ("olmoe", dict(allocation="global")),
    ("olmoe", dict(allocation="uniform")),
])
def test_moe_models_save_and_reload_after_any_allocation(name, options, moe, tmp_path):
    """Global allocation gives experts ranks (1, odd) that transformers' fused-experts save
    converters split as if they were the dense stacks: the save keeps the model's own names."""
    model, batches = moe.build(name), moe.batches(count=2)
    panther_lite.convert(model, calibration_data=batches, param_ratio=0.3, progress=False, **options)
    panther_lite.save_pretrained(model, tmp_path / "saved")
    assert _reloaded_error(model, tmp_path / "saved", batches) <= 1e-5


def _checkpoint(moe, name: str, directory: Path, save_checkpoint, own_names: bool) -> Path:
    """The tiny model and the word tokenizer: as transformers saves it (per-expert tensors), or
    with the model's own (fused) tensor names, which stream block by block."""
    from safetensors.torch import save_file

    model = moe.build(name)
    save_checkpoint(model, directory)
    if own_names:
        for path in directory.glob("model*.safetensors*"):
            path.unlink()
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("how", ["streamed", "in memory", "global, transformers' layout"])
def test_the_command_compresses_moe_checkpoints(name, how, moe, tmp_path, save_checkpoint, text_file, capsys):
    model_dir = _checkpoint(moe, name, tmp_path / "model", save_checkpoint, own_names=how == "streamed")
    extra = {"streamed": [], "in memory": ["--in-memory"], "global, transformers' layout": ["--allocation", "global"]}
    status = main(["compress", str(model_dir), "--calibration", str(text_file), "--output", str(tmp_path / "out"),
                   "--param-ratio", "0.5", "--quiet", *extra[how]])
    assert status == 0, capsys.readouterr().err
    report = __import__("pandas").read_csv(tmp_path / "out" / "report.csv")
    assert (report[report["kind"] == "Experts"]["status"] == "converted").any()
    loaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "out")
    assert any(type(module).__name__ == "SKExperts" for module in loaded.modules())


def test_a_command_error_is_never_printed_empty(monkeypatch, checkpoints, text_file, tmp_path, capsys):
    from panther_lite.cli import compress as command

    def fails(*args, **kwargs):
        raise NotImplementedError

    monkeypatch.setattr(command, "compress_checkpoint", fails)
    status = main(["compress", str(checkpoints["llama"]), "--calibration", str(text_file), "--output",
                   str(tmp_path / "out"), "--param-ratio", "0.5", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 1 and err.endswith("error: NotImplementedError without a message (a bug in panther_lite: please "
                                        "report it with this command)")


def test_every_kind_answers_the_command_s_calibration_width_question(moe):
    """The few-tokens warning reads each layer's input widths from its kind's records (an experts
    module: one per projection), never a weight matrix an experts kind does not have."""
    from panther_lite.cli.compress import _warn_if_few_tokens

    _warn_if_few_tokens(moe.build("mixtral"), tokens=10**6)  # raised NotImplementedError before
