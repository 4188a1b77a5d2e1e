"""transformers' quantizer plugin: after ``import panther_lite``, ``AutoModel*.from_pretrained(out)``
builds the sketched layers of a panther_lite output (LLaMA tied/untied, BERT, Mixtral experts, a
frozen model, float32 and bfloat16, outputs of ``convert`` + ``save_pretrained`` and of
``compress_checkpoint`` streamed and in memory) with outputs equal to ``panther_lite.from_pretrained``;
the loaded model saves, trains and reloads, and its transformers re-save stays guarded; outputs of earlier versions still load; without
panther_lite transformers fails loudly instead of loading random weights; importing panther_lite
does not import transformers."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion.saving.hf_guard import GUARD, GUARD_KEY  # noqa: E402
from panther_lite.conversion.saving.hf_quantizer import PantherLiteConfig, PantherLiteHfQuantizer  # noqa: E402
from panther_lite.nn import SKExperts, SKLinear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
ROOT = Path(__file__).resolve().parents[3]
VOCAB = 64
SKETCHED = (SKLinear, SKExperts)


def _llama(tie: bool = False):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tie))  # fmt: skip


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16))  # fmt: skip


def _mixtral():
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16))  # fmt: skip
    model.set_experts_implementation("eager")
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _sketched(model) -> list:
    return sorted(name for name, module in model.named_modules() if isinstance(module, SKETCHED))


def _layout(model) -> list:
    """Each module's name and type, and each tensor's name and shape."""
    return [(name, type(module).__name__) for name, module in model.named_modules()] + [
        (name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]


def _converted(build, dtype=torch.float32, frozen: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = build().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        panther_lite.convert(model, calibration_data=[_ids(2), _ids(3)], param_ratio=0.5, progress=False)
    if frozen:
        panther_lite.freeze(model)
    return model.to(dtype)


CASES = {
    "llama untied float32": (_llama, transformers.AutoModelForCausalLM, torch.float32, False),
    "llama tied bfloat16": (lambda: _llama(tie=True), transformers.AutoModelForCausalLM, torch.bfloat16, False),
    "bert": (_bert, transformers.AutoModelForMaskedLM, torch.float32, False),
    "mixtral experts": (_mixtral, transformers.AutoModelForCausalLM, torch.float32, False),
    "llama frozen": (_llama, transformers.AutoModelForCausalLM, torch.float32, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_model_builds_the_sketched_layers_and_equals_panther_lite_from_pretrained(case, tmp_path):
    build, auto, dtype, frozen = CASES[case]
    model = _converted(build, dtype, frozen)
    ids = _ids()
    expected = _logits(model, ids)
    panther_lite.save_pretrained(model, tmp_path)
    loaded = auto.from_pretrained(tmp_path)
    if case == "mixtral experts":
        loaded.set_experts_implementation("eager")
    assert isinstance(loaded.hf_quantizer, PantherLiteHfQuantizer) and type(loaded) is type(model)
    assert _layout(loaded) == _layout(model) and (_sketched(model) or frozen)
    assert {p.dtype for p in loaded.parameters()} == {dtype} and not any(t.is_meta for t in loaded.state_dict().values())
    reference = panther_lite.from_pretrained(auto, tmp_path)
    if case == "mixtral experts":
        reference.set_experts_implementation("eager")
    assert torch.equal(_logits(loaded, ids), _logits(reference, ids))
    if dtype == torch.float32:
        assert torch.equal(_logits(loaded, ids), expected)
    else:  # not bitwise: .to() also cast the rotary frequencies, which a fresh load keeps in float32
        torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1.6e-2, atol=2e-3)


def test_the_loaded_model_saves_with_transformers_and_reloads(tmp_path):
    model = _converted(_llama)
    ids = _ids()
    panther_lite.save_pretrained(model, tmp_path / "out")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert saved == {"quant_method": "panther_lite", "conversion": panther_lite.conversion_config(model)}
    assert torch.equal(_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again"), ids),
                       _logits(model, ids))


def test_loading_options_users_pass(tmp_path):
    model = _converted(_llama)
    panther_lite.save_pretrained(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, device_map="auto", low_cpu_mem_usage=True)
    assert _sketched(loaded) == _sketched(model)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(_logits(loaded, _ids()).float(), _logits(model, _ids()), rtol=0.05, atol=0.05)


def test_the_loaded_model_trains(tmp_path):
    panther_lite.save_pretrained(_converted(_llama), tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert loaded.hf_quantizer.is_trainable
    q_proj = loaded.model.layers[0].self_attn.q_proj
    before = q_proj.S1.detach().clone()
    optimizer = torch.optim.SGD([p for p in loaded.parameters() if p.requires_grad], lr=0.1)
    loaded(input_ids=_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    assert q_proj.S1.grad is not None and not torch.equal(q_proj.S1, before)


def test_the_loaded_model_casts_and_fine_tunes_as_a_float_model(tmp_path):
    """transformers refuses .half()/.float() and adapter-free fine-tuning of quantized models; a
    sketched model's parameters are floating tensors, so it allows both."""
    from transformers.trainer_utils import validate_quantization_for_training

    model = _converted(_llama)
    panther_lite.save_pretrained(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    validate_quantization_for_training(loaded)
    assert {p.dtype for p in loaded.half().parameters()} == {torch.float16}
    assert {p.dtype for p in loaded.float().parameters()} == {torch.float32}
    torch.testing.assert_close(_logits(loaded, _ids()), _logits(model, _ids()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("in_memory", [False, True], ids=["streamed", "in memory"])
def test_compress_checkpoint_outputs_load_with_auto_model(in_memory, tmp_path):
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path / "dense")
    panther_lite.compress_checkpoint(tmp_path / "dense", tmp_path / "out", calibration_data=[_ids(2), _ids(3)],
                                     param_ratio=0.5, progress=False, in_memory=in_memory)
    ids = _ids()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert _sketched(loaded)
    reference = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "out")
    assert torch.equal(_logits(loaded, ids), _logits(reference, ids))


def _as_earlier_version(directory: Path) -> None:
    """Rewrite a save as panther_lite 0.2 wrote it: the conversion under config.json's "panther_lite"."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["panther_lite"] = config.pop("quantization_config")["conversion"]
    del config[GUARD_KEY]
    path.write_text(json.dumps(config))


def test_outputs_of_earlier_versions_still_load(tmp_path):
    model = _converted(_llama)
    panther_lite.save_pretrained(model, tmp_path)
    _as_earlier_version(tmp_path)
    loaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert _sketched(loaded) == _sketched(model)
    assert torch.equal(_logits(loaded, _ids()), _logits(model, _ids()))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def _assert_transformers_alone_refuses(directory: Path) -> None:
    """A fresh process loading ``directory`` without panther_lite fails with the guard's ValueError."""
    result = _run(
        "import sys, transformers\n"
        f"transformers.AutoModelForCausalLM.from_pretrained({str(directory)!r})\n"
        "print('LOADED', 'panther_lite' in sys.modules)"
    )
    assert result.returncode != 0 and "LOADED" not in result.stdout
    assert "ValueError" in result.stderr and GUARD in result.stderr


def test_without_panther_lite_transformers_fails_loudly_instead_of_loading_random_weights(tmp_path):
    panther_lite.save_pretrained(_converted(_llama), tmp_path)
    _assert_transformers_alone_refuses(tmp_path)


def test_a_transformers_resave_of_the_loaded_model_keeps_failing_loudly_without_panther_lite(tmp_path):
    model = _converted(_llama)
    panther_lite.save_pretrained(model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded.save_pretrained(tmp_path / "again")  # transformers' own save, which drops the config's guard
    copy.deepcopy(loaded).save_pretrained(tmp_path / "copy")  # the copy saves through its own instance
    for again in (tmp_path / "again", tmp_path / "copy"):
        assert json.loads((again / "config.json").read_text())[GUARD_KEY] == GUARD
        assert torch.equal(_logits(transformers.AutoModelForCausalLM.from_pretrained(again), _ids()),
                           _logits(model, _ids()))
    _assert_transformers_alone_refuses(tmp_path / "again")


def test_importing_panther_lite_registers_the_plugin_when_transformers_loads_later(tmp_path):
    panther_lite.save_pretrained(_converted(_llama), tmp_path)
    result = _run(
        "import sys, panther_lite\n"
        "assert 'transformers' not in sys.modules, 'import panther_lite imported transformers'\n"
        "import transformers\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "print(type(model.model.layers[0].self_attn.q_proj).__name__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "SKLinear"


def test_a_dense_checkpoint_cannot_be_compressed_through_from_pretrained(tmp_path):
    model = _converted(_llama)
    _llama().save_pretrained(tmp_path)
    config = PantherLiteConfig(conversion=panther_lite.conversion_config(model))
    with pytest.raises(ValueError, match="pre-quantized"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)


def test_a_bad_quantization_config_is_a_clear_error():
    with pytest.raises(ValueError, match="conversion config"):
        PantherLiteConfig(conversion={"layers": []})
    with pytest.raises(ValueError, match="unknown fields"):
        PantherLiteConfig(conversion=panther_lite.conversion_config(torch.nn.Linear(2, 2)), bits=4)
