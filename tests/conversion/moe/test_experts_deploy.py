"""Converted experts modules after conversion: saved and rebuilt through the common saving path
(state_dict factories, meta-device rebuilds, the conversion config's per-projection sizes and
its validation), frozen to plain stacked factors that both ONNX exporters export and
onnxruntime runs, and tuned."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion import FrozenExperts, apply_conversion_config, conversion_config  # noqa: E402
from panther_lite.nn import SKExperts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HIDDEN, INTER, EXPERTS = 16, 24, 4


def moe_model(seed: int = 0) -> nn.Module:
    """``nn.Sequential(Linear, Mixtral sparse-MoE block)``: experts inside a non-transformers model."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), MixtralSparseMoeBlock(config))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape))
    return model.eval()


def inputs(tokens: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def converted():
    model = moe_model()
    panther_lite.convert(
        model, param_ratio=0.5, allocation="global", calibration_data=[inputs(seed=s) for s in range(3)], progress=False
    )
    return model


def test_conversion_config_records_each_projections_size_and_rebuilds_it(converted, tmp_path):
    entry = next(e for e in conversion_config(converted)["layers"] if e["kind"] == "SKExperts")
    sizes = converted[1].experts.sizes
    assert entry["dense"] == "Experts" and entry["shape"] == [EXPERTS, 2 * INTER, HIDDEN]
    assert entry["sizes"] == {name: list(pair) for name, pair in sizes.items()}
    panther_lite.save_pretrained(converted, tmp_path)
    loaded = panther_lite.from_pretrained(moe_model, tmp_path, seed=7)
    assert isinstance(loaded[1].experts, SKExperts) and loaded[1].experts.sizes == sizes
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), converted(inputs()))


def test_a_meta_model_gets_meta_experts_to_load_into(converted):
    with torch.device("meta"):
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = converted[1].experts.shell.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            skeleton = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), MixtralSparseMoeBlock(config))
    apply_conversion_config(skeleton, conversion_config(converted))
    assert skeleton[1].experts.gate_up_proj.S1.is_meta
    skeleton.load_state_dict(converted.state_dict(), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(skeleton.eval()(inputs()), converted(inputs()))


def test_bad_sizes_in_a_config_name_the_layer_and_change_nothing(converted):
    config = conversion_config(converted)
    entry = next(e for e in config["layers"] if e["kind"] == "SKExperts")
    for sizes, match in (
        ({"up": [1, 2]}, "'sizes' must map the experts' projections"),
        ({"down_proj": [1, 0]}, r"sizes\['down_proj'\] must be \[num_terms, low_rank\]"),
        ({"down_proj": [1, 99]}, "1.experts.down_proj"),
    ):
        entry["sizes"] = sizes
        fresh = moe_model()
        before = copy.deepcopy(fresh.state_dict())
        with pytest.raises(ValueError, match=match):
            apply_conversion_config(fresh, config)
        assert type(fresh[1].experts).__name__ == "MixtralExperts" and isinstance(fresh[0], nn.Linear)
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_frozen_experts_are_plain_stacked_factors_computing_the_same(converted):
    frozen = panther_lite.freeze(copy.deepcopy(converted))
    layer = frozen[1].experts
    assert isinstance(layer, FrozenExperts)
    names = {name for name, _ in layer.named_parameters()}
    assert names == {f"{p}.{f}" for p in ("gate_up_proj", "down_proj") for f in ("left", "right")}
    assert not list(layer.buffers())  # the fixed sketches are folded in
    for name, (num_terms, low_rank) in converted[1].experts.sizes.items():
        assert getattr(layer, name).left.shape[-1] == 2 * num_terms * low_rank
    with torch.no_grad():
        torch.testing.assert_close(frozen(inputs(7)), converted(inputs(7)), rtol=1e-4, atol=1e-5)
    saved = conversion_config(frozen)["layers"]
    assert next(e for e in saved if e["kind"] == "SKExperts")["frozen"] is True


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_frozen_experts_export_to_onnx_and_run_in_onnxruntime(converted, tmp_path, dynamo):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    layer = panther_lite.freeze(copy.deepcopy(converted))[1].experts.eval()
    generator = torch.Generator().manual_seed(0)

    def routing(tokens):
        hidden = torch.randn(tokens, HIDDEN, generator=generator)
        weights, index = torch.topk(torch.randn(tokens, EXPERTS, generator=generator).softmax(-1), 2)
        return hidden, index, weights

    path = tmp_path / "experts.onnx"
    names = ["hidden_states", "top_k_index", "top_k_weights"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dims = tuple({0: torch.export.Dim.DYNAMIC} for _ in names)
            torch.onnx.export(layer, routing(9), str(path), dynamo=True, input_names=names, dynamic_shapes=dims)
        else:
            axes = {name: {0: "tokens"} for name in names}
            torch.onnx.export(layer, routing(9), str(path), dynamo=False, input_names=names, dynamic_axes=axes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for tokens in (1, 5, 23):
        args = routing(tokens)
        got = session.run(None, {name: value.numpy() for name, value in zip(names, args)})[0]
        with torch.no_grad():
            expected = layer(*args).numpy()
        assert np.abs(got - expected).max() <= 1e-4 * max(np.abs(expected).max(), 1e-6)
    graph = onnx.load(str(path))
    stored = sum(p.numel() for p in layer.parameters())
    weights = sum(np.prod(init.dims) for init in graph.graph.initializer if init.data_type == onnx.TensorProto.FLOAT)
    assert weights <= 1.1 * stored  # the low-rank factors, no dense expert weight


def _nearly_low_rank_experts(model: nn.Module, rank: int = 3) -> nn.Module:
    """``model`` with each expert's weights a rank-``rank`` product plus 1% noise (compressible)."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for weight in (model[1].experts.gate_up_proj, model[1].experts.down_proj):
            experts, rows, cols = weight.shape
            left = torch.randn(experts, rows, rank, generator=generator)
            right = torch.randn(experts, rank, cols, generator=generator)
            weight.copy_((left @ right) / rank + 0.01 * torch.randn(weight.shape, generator=generator))
    return model


def test_tune_finds_a_budget_for_a_model_with_experts():
    model, data = _nearly_low_rank_experts(moe_model()), [inputs(seed=s) for s in range(3)]
    dense = copy.deepcopy(model)
    held_out = inputs(seed=9)
    with torch.no_grad():
        reference = dense(held_out)

    def score(candidate):
        with torch.no_grad():
            return -float((candidate(held_out) - reference).norm() / reference.norm())

    report = panther_lite.tune(model, score, tolerance=0.05, calibration_data=data, progress=False)
    assert score(model) >= -0.05 - 1e-9 and report.attrs["tune_budget"] < 1
    assert (report.loc[report["kind"] == "Experts", "status"] == "converted").all()
    assert isinstance(model[1].experts, SKExperts)
