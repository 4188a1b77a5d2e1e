"""Deploying tiny Hugging Face models: GPT-2 (its Conv1D layers converted) and BERT go
convert → (freeze →) ONNX → onnxruntime with dynamic batch and sequence axes and match
PyTorch to 1e-4 relative; a frozen GPT-2 saves and reloads through transformers' loader."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion import FrozenLinear  # noqa: E402
from panther_lite.conversion.kinds.hf_conv1d import SKLinearConv1D  # noqa: E402

VOCAB = 64
RELATIVE_TOLERANCE = 1e-4


class FirstOutput(nn.Module):
    """``ids -> logits`` (or the last hidden state): the tensor an exported graph returns."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids)[0]


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
    return transformers.BertModel(config).eval()


def export_and_compare(model: nn.Module, path, dynamo: bool) -> None:
    """Export ``ids -> output`` with dynamic batch and sequence and compare onnxruntime with
    PyTorch on another batch size and sequence length."""
    wrapped = FirstOutput(model).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            shapes = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
            torch.onnx.export(wrapped, (ids,), str(path), dynamo=True, input_names=["ids"], dynamic_shapes=shapes)
        else:
            axes = {"ids": {0: "batch", 1: "sequence"}}
            torch.onnx.export(wrapped, (ids,), str(path), dynamo=False, input_names=["ids"], dynamic_axes=axes)
    other = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    actual = session.run(None, {"ids": other.numpy()})[0]
    with torch.no_grad():
        expected = wrapped(other).numpy()
    assert np.abs(actual - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_converted_gpt2_exports_to_onnx(tmp_path, dynamo):
    model = tiny_gpt2()
    panther_lite.convert(model, num_terms=1, low_rank=2)
    assert any(isinstance(m, SKLinearConv1D) for m in model.modules())
    export_and_compare(model, tmp_path / "gpt2.onnx", dynamo)


def test_frozen_bert_exports_to_onnx(tmp_path):
    model = tiny_bert()
    panther_lite.convert(model, num_terms=1, low_rank=2)
    panther_lite.freeze(model)
    assert any(isinstance(m, FrozenLinear) for m in model.modules())
    export_and_compare(model, tmp_path / "bert.onnx", dynamo=False)


def test_frozen_gpt2_round_trips_through_transformers_loader(tmp_path):
    model = tiny_gpt2()
    panther_lite.convert(model, num_terms=1, low_rank=2)
    panther_lite.freeze(model)
    assert {e["dense"] for e in panther_lite.conversion_config(model)["layers"]} == {"Conv1D"}
    panther_lite.save_pretrained(model, tmp_path / "saved")
    loaded = panther_lite.from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "saved").eval()
    assert isinstance(loaded.transformer.h[0].attn.c_attn, FrozenLinear)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
