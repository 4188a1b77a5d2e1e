"""The model matrix beyond the text decoders: tiny random-init Whisper, Wav2Vec2 (both feature
extractor norms), SegFormer, 4-stage ResNet and ConvNeXt, Gemma 2 (alternating sliding-window
layers) and Qwen 2 (sliding windows in some layers) go through convert with default options,
by blocks equal bit for bit to the whole model (uniform and sequential; the decoders' first batch
inside the window), global + sequential, save/load, freeze + ONNX (both exporters), frozen
save/load and densify."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Callable, List

import numpy as np
import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion import FrozenConv1d, FrozenConv2d, FrozenLinear  # noqa: E402
from panther_lite.conversion.calibration.batches import run_batch  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # "never reached": the decoders' unused heads
]

WINDOW = 4


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def _whisper_batches() -> List[dict]:
    generator = _generator()
    return [
        dict(input_features=torch.randn(2, 8, 32, generator=generator),
             decoder_input_ids=torch.randint(3, 64, (2, 4), generator=generator))
        for _ in range(2)
    ]


def _wav2vec2(norm: str) -> Callable[[], nn.Module]:
    def build():
        config = transformers.Wav2Vec2Config(
            vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, feat_extract_norm=norm, do_stable_layer_norm=norm == "layer",
        )
        return transformers.Wav2Vec2ForCTC(config)

    return build


def _audio() -> List[torch.Tensor]:
    generator = _generator()
    return [torch.randn(2, 400, generator=generator) for _ in range(2)]


def _segformer() -> nn.Module:
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=3, patch_sizes=[7, 3], strides=[4, 2],
    )
    return transformers.SegformerForSemanticSegmentation(config)


def _resnet() -> nn.Module:
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], layer_type="basic", num_labels=3
    )
    return transformers.ResNetForImageClassification(config)


def _convnext() -> nn.Module:
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], num_labels=3, patch_size=2)
    return transformers.ConvNextForImageClassification(config)


def _images() -> List[torch.Tensor]:
    generator = _generator()
    return [torch.randn(2, 3, 32, 32, generator=generator) for _ in range(2)]


def _gemma2() -> nn.Module:
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=WINDOW, max_position_embeddings=32,
    )
    return transformers.Gemma2ForCausalLM(config)


def _qwen2() -> nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        max_position_embeddings=32, attn_implementation="eager",  # the TorchScript exporter lacks SDPA with GQA
    )
    return transformers.Qwen2ForCausalLM(config)


def _tokens() -> List[dict]:
    """The first batch fits inside the sliding window (every mask is then the full causal one),
    the next two do not."""
    generator = _generator()
    return [dict(input_ids=torch.randint(0, 64, (2, length), generator=generator)) for length in (WINDOW - 1, 10, 7)]


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    batches: Callable[[], list]
    load_with: type
    blocks: str  # the block list convert finds
    before_blocks: str = ""  # a layer to convert that runs before them: sequential falls back


FAMILIES = {
    "whisper": Family(
        _whisper, _whisper_batches, transformers.WhisperForConditionalGeneration, "2 blocks at model.encoder.layers",
        "model.encoder.conv1",
    ),
    "wav2vec2-group": Family(
        _wav2vec2("group"), _audio, transformers.Wav2Vec2ForCTC, "2 blocks at wav2vec2.encoder.layers",
        "wav2vec2.feature_extractor.conv_layers.0.conv",
    ),
    "wav2vec2-layer": Family(
        _wav2vec2("layer"), _audio, transformers.Wav2Vec2ForCTC, "3 blocks at wav2vec2.feature_extractor.conv_layers"
    ),
    "segformer": Family(_segformer, _images, transformers.SegformerForSemanticSegmentation, "2 blocks at segformer.stages"),
    "resnet": Family(
        _resnet, _images, transformers.ResNetForImageClassification, "4 blocks at resnet.encoder.stages",
        "resnet.embedder.embedder.convolution",
    ),
    "convnext": Family(
        _convnext, _images, transformers.ConvNextForImageClassification, "4 blocks at convnext.encoder.stages",
        "convnext.embeddings.patch_embeddings",
    ),
    "gemma2": Family(_gemma2, _tokens, transformers.Gemma2ForCausalLM, "2 blocks at model.layers"),
    "qwen2": Family(_qwen2, _tokens, transformers.Qwen2ForCausalLM, "4 blocks at model.layers"),
}


def _logits(model: nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        return run_batch(model, batch).logits


def _assert_same_model(model: nn.Module, reference: nn.Module, batches) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert all(torch.equal(_logits(model, batch), _logits(reference, batch)) for batch in batches)


@dataclass
class Converted:
    family: Family
    dense: nn.Module
    model: nn.Module  # converted with default options (blocks="auto")
    report: object
    batches: list


def _convert(model: nn.Module, batches, **options):
    converted = copy.deepcopy(model)
    report = panther_lite.convert(converted, param_ratio=0.5, calibration_data=batches, progress=False, **options)
    return converted, report


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, one_thread) -> Converted:
    family = FAMILIES[request.param]
    torch.manual_seed(0)
    dense, batches = family.build().eval(), family.batches()
    model, report = _convert(dense, batches)
    return Converted(family, dense, model, report, batches)


def test_converts_with_default_options_block_by_block_as_the_whole_model_does(converted):
    report = converted.report
    assert report.attrs["pipeline"] == f"block pipeline: {converted.family.blocks}"
    assert (report["status"] == "converted").sum() >= 4
    whole, _ = _convert(converted.dense, converted.batches, blocks=False)
    _assert_same_model(converted.model, whole, converted.batches)


def test_sequential_by_blocks_is_the_whole_models_or_falls_back_saying_why(converted):
    family, dense, batches = converted.family, converted.dense, converted.batches
    model, report = _convert(dense, batches, sequential=True)
    if family.before_blocks:
        assert report.attrs["pipeline"].startswith(f"whole model: sequential=True converts layer {family.before_blocks!r}")
        return
    assert report.attrs["pipeline"] == f"block pipeline: {family.blocks}"
    _assert_same_model(model, _convert(dense, batches, blocks=False, sequential=True)[0], batches)


def test_global_sequential_keeps_the_budget_and_the_outputs_finite(converted):
    model, report = _convert(converted.dense, converted.batches, allocation="global", sequential=True)
    pooled = report[report["status"] != "skipped"]  # the budget is shared by the layers that can convert
    assert pooled["stored_params"].sum() <= 0.5 * pooled["dense_params"].sum()
    assert all(torch.isfinite(_logits(model, batch)).all() for batch in converted.batches)


def _assert_reloads(model: nn.Module, family: Family, directory, batch) -> None:
    """The model saved and loaded again computes what it computes: the same tensors, and outputs
    equal up to float32 rounding (loaded tensors sit at other memory alignments, where oneDNN's
    convolutions may sum in another order)."""
    panther_lite.save_pretrained(model, directory)
    loaded = panther_lite.from_pretrained(family.load_with, directory).eval()
    got, want = loaded.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in model.modules()]
    torch.testing.assert_close(_logits(loaded, batch), _logits(model, batch), rtol=1e-6, atol=1e-7)


def test_save_and_load_give_the_same_model(converted, tmp_path):
    _assert_reloads(converted.model, converted.family, tmp_path, converted.batches[-1])


def test_densify_keeps_the_function(converted):
    dense = panther_lite.densify(copy.deepcopy(converted.model))
    batch = converted.batches[-1]
    torch.testing.assert_close(_logits(dense, batch), _logits(converted.model, batch), rtol=1e-4, atol=1e-5)


class _Logits(nn.Module):
    """``*tensors -> logits`` (the batch's tensors in order, as keywords): what ONNX exports."""

    def __init__(self, model: nn.Module, names: List[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors):
        return self.model(**dict(zip(self.names, tensors))).logits


def _export_and_compare(model: nn.Module, batch, path, dynamo: bool) -> None:
    ort = pytest.importorskip("onnxruntime")
    batch = batch if isinstance(batch, dict) else {"input_values": batch} if batch.dim() == 2 else {"pixel_values": batch}
    wrapped, inputs = _Logits(model, list(batch)).eval(), tuple(batch.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapped, inputs, str(path), dynamo=dynamo, input_names=list(batch))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    actual = session.run(None, {name: value.numpy() for name, value in batch.items()})[0]
    with torch.no_grad():
        expected = wrapped(*inputs).numpy()
    assert np.abs(actual - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_frozen_model_runs_exports_to_onnx_and_reloads(converted, tmp_path, dynamo):
    pytest.importorskip("onnx")
    model, batch = panther_lite.freeze(copy.deepcopy(converted.model)), converted.batches[-1]
    assert any(isinstance(m, (FrozenLinear, FrozenConv1d, FrozenConv2d)) for m in model.modules())
    torch.testing.assert_close(_logits(model, batch), _logits(converted.model, batch), rtol=1e-4, atol=1e-5)
    _export_and_compare(model, batch, tmp_path / "model.onnx", dynamo)
    if not dynamo:
        _assert_reloads(model, converted.family, tmp_path / "saved", batch)
