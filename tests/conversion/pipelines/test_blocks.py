"""The block-by-block pipeline: block discovery on transformers models and by path, the same
fits as whole-model calibration where the statistics are the same, sequential and global runs,
atomic rollback, the refinement hook, and the fallback said in the report."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import panther_lite  # noqa: E402
from panther_lite.conversion.calibration.batches import CalibrationData  # noqa: E402
from panther_lite.conversion.pipelines import ByBlocks, Conversion, by_blocks  # noqa: E402
from panther_lite.conversion.pipelines.blocks import find_blocks  # noqa: E402
from panther_lite.conversion.selection import select_layers  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

VOCAB, HIDDEN, FFN, HEADS, LAYERS = 64, 32, 64, 4, 3


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
    )
    return transformers.BertForMaskedLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=2, num_heads=HEADS,
    )
    return transformers.T5ForConditionalGeneration(config)


def _batches(count: int = 3):
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=generator)} for _ in range(count)]


def _found(model: nn.Module, blocks="auto"):
    return find_blocks(model, select_layers(model, None, None, None), blocks)


@pytest.mark.parametrize(
    "build, path",
    [(_llama, "model.layers"), (_gpt2, "transformer.h"), (_bert, "bert.encoder.layer"), (_t5, "encoder.block")],
    ids=["llama", "gpt2", "bert", "t5"],
)
def test_finds_the_repeated_block_list(build, path):
    block_list, description = _found(build())
    assert block_list.path == path and len(block_list.blocks) == LAYERS
    assert description == f"{LAYERS} blocks at {path}"


def test_a_named_block_list_is_used_and_a_bad_one_is_a_clear_error():
    model = _t5()
    assert _found(model, "decoder.block")[0].path == "decoder.block"
    with pytest.raises(ValueError, match="'decoder.nope'.*no submodule"):
        _found(model, "decoder.nope")
    with pytest.raises(ValueError, match="'lm_head' is a Linear; expected a non-empty nn.ModuleList"):
        _found(model, "lm_head")
    with pytest.raises(TypeError, match="blocks must be"):
        panther_lite.ConvertConfig(param_ratio=0.5, blocks=3)


def test_a_model_without_a_block_list_falls_back_and_says_so():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    report = panther_lite.convert(mlp, param_ratio=0.5, calibration_data=[torch.randn(4, 8)], progress=False)
    assert report.attrs["pipeline"].startswith("whole model: no list of two or more same-class blocks")
    report = panther_lite.convert(_llama(), param_ratio=0.5, progress=False)
    assert report.attrs["pipeline"] == "whole model: no calibration data, so nothing runs block by block"


@pytest.mark.parametrize("sequential", [False, True], ids=["calibrated", "sequential"])
def test_block_pipeline_gives_the_whole_model_fits(sequential):
    """Block inputs are the tensors a whole-model forward feeds the blocks, so the fits (and
    the converted model's logits) are the same bit for bit, lm_head included."""
    dense, batches = _llama(), _batches()
    by_blocks, whole = copy.deepcopy(dense), copy.deepcopy(dense)
    options = dict(param_ratio=0.5, calibration_data=batches, progress=False, sequential=sequential)
    report = panther_lite.convert(by_blocks, **options)
    reference = panther_lite.convert(whole, blocks=False, **options)
    assert report.attrs["pipeline"] == "block pipeline: 3 blocks at model.layers"
    assert reference.attrs["pipeline"] == "whole model: blocks=False"
    assert report["low_rank"].equals(reference["low_rank"])
    assert report["output_error"].tolist() == pytest.approx(reference["output_error"].tolist(), rel=1e-9, nan_ok=True)
    got, want = by_blocks.state_dict(), whole.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with torch.no_grad():
        assert all(torch.equal(by_blocks(**batch).logits, whole(**batch).logits) for batch in batches)


def test_global_sequential_runs_with_finite_errors_and_keeps_the_cache_setting():
    model = _llama()
    report = panther_lite.convert(
        model, param_ratio=0.5, calibration_data=_batches(), progress=False, allocation="global", sequential=True
    )
    converted = report[report["status"] == "converted"]
    assert len(converted) > 0 and converted["output_error"].map(lambda e: 0 <= e < 1).all()
    assert report.attrs["pipeline"].startswith("block pipeline")
    assert set(converted["init"]) == {"sequential"}
    assert model.config.use_cache is True
    assert report["stored_params"].sum() <= 0.5 * report["dense_params"].sum()


def test_a_failure_in_a_later_block_undoes_every_swap(monkeypatch):
    model = _llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    real, calls = by_blocks.fit_planned, []

    def fail_on_second_block(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("fit failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(by_blocks, "fit_planned", fail_on_second_block)
    with pytest.raises(RuntimeError, match="fit failed"):
        panther_lite.convert(model, param_ratio=0.5, calibration_data=_batches(), progress=False)
    assert not any(isinstance(module, SKLinear) for module in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)


def test_each_fitted_block_offers_its_calls_targets_and_predictions():
    model, batches = _llama(), _batches(2)
    records = select_layers(model, None, None, None)
    block_list, _ = find_blocks(model, records, "auto")
    for record in records:
        record.num_terms, record.low_rank = 1, 4
    seen = []

    def after_fit(fitted):
        assert isinstance(fitted.block.self_attn.q_proj, SKLinear)
        seen.append(fitted.index)
        for index, target in enumerate(fitted.targets):
            assert fitted.predict(index).shape == target.shape == (2, 12, HIDDEN)

    config = panther_lite.ConvertConfig(num_terms=1, low_rank=4, progress=False)
    job = Conversion(model, config, CalibrationData(batches), records)
    pipeline = ByBlocks(block_list, "", config)
    assert pipeline.capture(job) is None
    with torch.no_grad():
        by_blocks.convert_by_blocks(job, block_list, pipeline.captured, after_fit, pipeline.materialise)
    assert seen == list(range(LAYERS))


def test_t5_runs_by_blocks_exactly_but_falls_back_or_is_refused_when_sequential():
    """T5's first block computes a position bias it returns and the model passes to the others:
    exact when every block is fed the dense model's inputs; under ``sequential`` a replay on
    converted inputs would take it from the dense model."""
    model, batches = _t5(), _batches(2)
    for batch in batches:
        batch["decoder_input_ids"] = batch["input_ids"][:, :4]
    options = dict(param_ratio=0.5, calibration_data=batches, progress=False)
    auto, whole = copy.deepcopy(model), copy.deepcopy(model)
    report = panther_lite.convert(auto, **options)
    panther_lite.convert(whole, blocks=False, **options)
    assert report.attrs["pipeline"] == f"block pipeline: {LAYERS} blocks at encoder.block"
    got, want = auto.state_dict(), whole.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    report = panther_lite.convert(copy.deepcopy(model), sequential=True, **options)
    assert report.attrs["pipeline"].startswith(
        "whole model: sequential=True feeds converted blocks to the next, but block 1 at encoder.block receives a "
        "tensor made after the first block was called"
    )
    with pytest.raises(ValueError, match="blocks='decoder.block': sequential=True .* block 1 at decoder.block receives"):
        panther_lite.convert(model, blocks="decoder.block", target_modules=r"decoder\..*", sequential=True, **options)
    assert not any(isinstance(module, SKLinear) for module in model.modules())


@pytest.mark.cuda
def test_calibration_on_the_gpu_converts_a_cpu_model_as_on_the_cpu():
    """The model stays on the CPU; each block visits the GPU only while it is calibrated."""
    model, batches = _llama(), _batches(2)
    on_cpu, on_gpu = copy.deepcopy(model), copy.deepcopy(model)
    options = dict(param_ratio=0.5, calibration_data=batches, progress=False, decomposition="exact", sequential=True)
    panther_lite.convert(on_cpu, **options)
    report = panther_lite.convert(on_gpu, calibration_device="cuda", **options)
    assert report.attrs["pipeline"].startswith("block pipeline")
    assert {p.device.type for p in on_gpu.parameters()} == {"cpu"}
    with torch.no_grad():
        torch.testing.assert_close(on_gpu(**batches[0]).logits, on_cpu(**batches[0]).logits, rtol=1e-6, atol=1e-6)
