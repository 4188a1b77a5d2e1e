"""A transformers model converted in memory and saved with transformers' own ``save_pretrained``
(not ``panther_lite.save_pretrained``) records its conversion, as does a fresh model given the
layout by hand (``apply_conversion_config``): with panther_lite imported
``AutoModel*.from_pretrained`` gives the converted model (tiny LLaMA and BERT, frozen too), in a
fresh process without panther_lite transformers fails loudly naming it; after ``densify`` (of the
converted or of a loaded model) the save is a plain dense checkpoint again."""
from __future__ import annotations

import json
import os
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
from panther_lite.nn import SKLinear  # noqa: E402

VOCAB = 64
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=16)
MODELS = {  # name: (random-init model, the Auto class that loads it)
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SIZES)),
              "AutoModelForCausalLM"),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(**SIZES)), "AutoModelForMaskedLM"),
}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids(1)).logits


def _converted(name: str, frozen: bool = False):
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        panther_lite.convert(model, calibration_data=[_ids(2), _ids(3)], param_ratio=0.5, progress=False)
    return panther_lite.freeze(model) if frozen else model


def _load(name: str, directory: Path):
    return getattr(transformers, MODELS[name][1]).from_pretrained(directory)


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _layout(model) -> list:
    return [(name, type(module).__name__) for name, module in model.named_modules()]


@pytest.mark.parametrize("frozen", [False, True], ids=["sketched", "frozen"])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_save_of_a_converted_model_loads_it_back_through_auto_model(name, frozen, tmp_path):
    model = _converted(name, frozen)
    model.save_pretrained(tmp_path)  # transformers' own save
    config = _config(tmp_path)
    assert config["quantization_config"] == {"quant_method": "panther_lite",
                                             "conversion": panther_lite.conversion_config(model)}
    assert config[GUARD_KEY] == GUARD and "quantization_config" not in model.config.__dict__
    loaded = _load(name, tmp_path)
    assert _layout(loaded) == _layout(model) and (frozen or any(isinstance(m, SKLinear) for m in loaded.modules()))
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("frozen", [False, True], ids=["sketched", "frozen"])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_save_of_a_model_rebuilt_by_hand_records_its_conversion(name, frozen, tmp_path):
    model = _converted(name, frozen)
    fresh = panther_lite.apply_conversion_config(MODELS[name][0]().eval(), panther_lite.conversion_config(model))
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(tmp_path)  # transformers' own save
    config = _config(tmp_path)
    assert config["quantization_config"]["conversion"] == panther_lite.conversion_config(model)
    assert config[GUARD_KEY] == GUARD
    loaded = _load(name, tmp_path)
    assert _layout(loaded) == _layout(model)
    assert torch.equal(_logits(loaded), _logits(model))


def _densified_saves(name: str, tmp_path: Path) -> Path:
    """Densify the converted model and a model loaded through the plugin, save both with
    transformers; check they hold no trace of panther_lite and reload dense and equal."""
    model = _converted(name)
    model.save_pretrained(tmp_path / "out")
    loaded = _load(name, tmp_path / "out")
    for dense, directory in ((panther_lite.densify(model), tmp_path / "dense"),
                             (panther_lite.densify(loaded), tmp_path / "dense_loaded")):
        assert "save_pretrained" not in dense.__dict__ and getattr(dense, "hf_quantizer", None) is None
        dense.save_pretrained(directory)
        assert not {"quantization_config", GUARD_KEY} & set(_config(directory))
        again = _load(name, directory)
        assert not any(isinstance(m, SKLinear) for m in again.modules())
        assert torch.equal(_logits(again), _logits(dense))
    return tmp_path / "out"


def test_densify_removes_what_convert_and_loading_attached(tmp_path):
    for name in MODELS:
        _densified_saves(name, tmp_path / name)


def test_without_panther_lite_the_transformers_save_fails_loudly_and_the_densified_one_loads(tmp_path):
    cases = [(MODELS[name][1], str(_densified_saves(name, tmp_path / name)), str(tmp_path / name / "dense"))
             for name in MODELS]
    code = (
        "import sys, transformers\n"
        f"for auto, converted, dense in {cases!r}:\n"
        "    getattr(transformers, auto).from_pretrained(dense)\n"
        "    try:\n"
        "        getattr(transformers, auto).from_pretrained(converted)\n"
        "        print('LOADED', auto)\n"
        "    except ValueError as error:\n"
        "        print('REFUSED', auto, str(error))\n"
        "assert 'panther_lite' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[3], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    refused = [line for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert "LOADED" not in result.stdout and len(refused) == len(MODELS)
    assert all(GUARD in line and "panther_lite" in line for line in refused)
