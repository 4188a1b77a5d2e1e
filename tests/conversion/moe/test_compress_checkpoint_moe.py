"""compress_checkpoint on mixture-of-experts checkpoints (tiny random-init Mixtral and Qwen2-MoE):
one that transformers saved (per-expert tensors on disk, fused experts in the model: read through
transformers' conversion mapping) and one holding the model's own tensor names both stream block
by block (the Experts kind's recorders, parts and per-expert report columns) and give the model
and report ``convert`` gives in memory, also after a stop and resume."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*gradient_checkpointing")]


def _batches(moe):
    """Token batches with an attention mask, part of one row padded."""
    batches = [dict(input_ids=ids, attention_mask=torch.ones_like(ids)) for ids in moe.batches(count=3)]
    batches[0]["attention_mask"][1, 10:] = 0
    return batches


def _own_names(moe, name: str, directory: Path) -> Path:
    """The model's state dict under its own names in one safetensors file, and its config."""
    from safetensors.torch import save_file

    model = moe.build(name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    directory.mkdir()
    tensors = {key: value.contiguous() for key, value in model.state_dict().items() if key not in tied}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(directory))
    return directory


def _logit_error(output: Path, expected, batches) -> float:
    loaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, output).eval()
    with torch.no_grad():
        pairs = [(loaded(**batch).logits, expected(**batch).logits) for batch in batches]
    return max(float((got - want).norm() / want.norm()) for got, want in pairs)


def _in_memory(moe, name: str, batches, **options):
    model = moe.build(name)
    return model, panther_lite.convert(model, calibration_data=batches, progress=False, **options)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_checkpoint_transformers_saved_streams_its_per_expert_tensors(name, moe, tmp_path):
    moe.build(name).save_pretrained(str(tmp_path / "model"), safe_serialization=True)
    batches = _batches(moe)
    report = panther_lite.compress_checkpoint(tmp_path / "model", tmp_path / "out", calibration_data=batches,
                                              param_ratio=0.5, progress=False)
    assert report.attrs["pipeline"].startswith("out of core: ")
    expected, expected_report = _in_memory(moe, name, batches, param_ratio=0.5)
    assert (report["kind"] == "Experts").sum() == 4 and report.equals(expected_report)
    assert _logit_error(tmp_path / "out", expected, batches) <= 1e-4


@pytest.mark.parametrize("name,options", [
    ("mixtral", dict(param_ratio=0.5)),
    ("qwen2_moe", dict(param_ratio=0.5, allocation="global")),
    ("mixtral", dict(param_ratio=0.5, allocation="global", sequential=True)),
], ids=["mixtral uniform", "qwen2_moe global", "mixtral global + sequential"])
def test_a_checkpoint_with_the_models_names_streams_and_equals_convert_in_memory(name, options, moe, tmp_path):
    model_dir, batches = _own_names(moe, name, tmp_path / "model"), _batches(moe)
    report = panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, progress=False,
                                              **options)
    expected, expected_report = _in_memory(moe, name, batches, **options)
    assert report.attrs["pipeline"].startswith("out of core: ")
    experts = report[report["kind"] == "Experts"]
    assert len(experts) == 4 and (experts["status"] == "converted").all()
    assert report.equals(expected_report) and report.attrs["summary"] == expected_report.attrs["summary"]
    assert _logit_error(tmp_path / "out", expected, batches) <= 1e-4


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "report.png"}


def test_a_stopped_streamed_moe_run_resumes_bit_for_bit(moe, tmp_path, stopped_after_first_block):
    model_dir, batches = _own_names(moe, "mixtral", tmp_path / "model"), _batches(moe)
    options = dict(param_ratio=0.5, allocation="global", progress=False)
    whole = panther_lite.compress_checkpoint(model_dir, tmp_path / "whole", calibration_data=batches, **options)
    with stopped_after_first_block():
        panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, **options)
    resumed = panther_lite.compress_checkpoint(model_dir, tmp_path / "out", calibration_data=batches, resume=True,
                                               **options)
    assert resumed.equals(whole) and _tree(tmp_path / "out") == _tree(tmp_path / "whole")
