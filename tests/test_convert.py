"""panther_lite.convert / densify / conversion configs: model surgery on real, trained models."""
import copy
import importlib
import importlib.util
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

from panther_lite import apply_conversion_config, conversion_config, conversion_summary, convert, densify
from panther_lite.nn import SKConv2d, SKLinear, select_config

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- digits models


@pytest.fixture(scope="module")
def digits():
    """Digits pixels scaled to [0, 1] (float64), split 50/50 with a fixed permutation (a
    large test set, so one point of accuracy is nine images)."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float64) / 16
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = len(x) // 2
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def train(model, x, y, epochs, seed):
    """AdamW with weight decay (what low-rank compression assumes of a trained model)."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1.0)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(64):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).double().mean().item()


@pytest.fixture(scope="module")
def trained_mlp(digits):
    x, y, _, _ = digits
    torch.manual_seed(2)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).double()
    return train(mlp, x, y, epochs=20, seed=2)


@pytest.fixture(scope="module")
def trained_cnn(digits):
    x, y, _, _ = digits
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1024, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).double()
    return train(cnn, x.view(-1, 1, 8, 8), y, epochs=6, seed=0)


def converted_accuracies(model, head, x_train, x_test, y_test):
    """Test accuracy after converting copies at param_ratio=0.25 (the classifier head, whose
    budget allows only rank 2 of 10, stays dense) with each init."""
    results = {}
    for name, kwargs in (
        ("svd", {}),
        ("calibrated", dict(calibration_data=x_train.split(256))),
        ("sketch", dict(init="sketch", seed=0)),
    ):
        model_copy = copy.deepcopy(model)
        report = convert(model_copy, param_ratio=0.25, exclude_modules=[head], progress=False, **kwargs)
        results[name] = (accuracy(model_copy, x_test, y_test), report)
    return results


def test_mlp_keeps_accuracy_at_a_quarter_of_the_size(digits, trained_mlp):
    x, _, x_test, y_test = digits
    dense = accuracy(trained_mlp, x_test, y_test)
    results = converted_accuracies(trained_mlp, "4", x, x_test, y_test)
    assert dense > 0.93
    for name in ("svd", "calibrated"):
        acc, report = results[name]
        assert acc >= dense - 0.01, (name, acc, dense)
        assert list(report["status"]) == ["converted", "converted"]
        assert (report["stored_ratio"] <= 0.25).all()
        assert (report["init"] == name).all()
    assert results["sketch"][0] < dense - 0.3  # the anchor's conversion turns the model into noise
    # The calibrated fit is the output-optimal one: no worse than the weight fit on that data.
    svd_report = convert(copy.deepcopy(trained_mlp), param_ratio=0.25, exclude_modules=["4"],
                         calibration_data=[x], init="svd", progress=False)
    calibrated = results["calibrated"][1]
    assert (calibrated["output_error"].to_numpy() <= svd_report["output_error"].to_numpy() * (1 + 1e-3)).all()
    assert (calibrated["weight_error"].to_numpy() >= svd_report["weight_error"].to_numpy() * (1 - 1e-9)).all()


def test_cnn_keeps_accuracy_and_keeps_tiny_conv_dense(digits, trained_cnn):
    x, _, x_test, y_test = digits
    x, x_test = x.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
    dense = accuracy(trained_cnn, x_test, y_test)
    results = converted_accuracies(trained_cnn, "8", x, x_test, y_test)
    assert dense > 0.93
    for name in ("svd", "calibrated"):
        assert results[name][0] >= dense - 0.01, (name, results[name][0], dense)
    assert results["sketch"][0] < dense - 0.3
    report = results["calibrated"][1]
    assert list(report["kind"]) == ["Conv2d", "Conv2d", "Linear"]
    assert list(report["status"]) == ["kept dense", "converted", "converted"]
    assert "0.25" in report.loc[0, "reason"]
    assert report.loc[0, "stored_params"] == report.loc[0, "dense_params"] == 32 * 9 + 32


# --------------------------------------------------------------------------- report


def test_report_errors_match_direct_computation(digits, trained_mlp):
    x = digits[0]
    model = copy.deepcopy(trained_mlp)
    with torch.no_grad():
        hidden = trained_mlp[1](trained_mlp[0](x))  # input of layer "2"
    report = convert(model, param_ratio=0.25, calibration_data=[x[:700], x[700:]], exclude_modules=["4"], progress=False)
    for name, inputs in (("0", x), ("2", hidden)):
        row = report.set_index("name").loc[name]
        dense, sketched = trained_mlp.get_submodule(name), model.get_submodule(name)
        w, w_hat = dense.weight, sketched.effective_weight().detach()
        expected_output = ((inputs @ (w - w_hat).t()).norm() / (inputs @ w.t()).norm()).item()
        assert row["output_error"] == pytest.approx(expected_output, rel=1e-9)
        assert row["weight_error"] == pytest.approx(((w_hat - w).norm() / w.norm()).item(), rel=1e-12)
        assert row["trainable_params"] == sum(p.numel() for p in sketched.parameters())
        assert row["stored_params"] == row["trainable_params"] + sum(b.numel() for b in sketched.buffers())
        assert row["dense_params"] == dense.weight.numel() + dense.bias.numel()
    before = sum(p.numel() for p in trained_mlp.parameters())
    after = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
    summary = report.attrs["summary"]
    assert summary == conversion_summary(report)
    assert summary.startswith("converted 2 of 2 selected layers")
    assert f"whole model {before:,} → {after:,}" in summary


@pytest.mark.parametrize(
    "options",
    [
        dict(padding=1),
        dict(padding="same", padding_mode="reflect"),
        dict(padding=2, stride=2, dilation=2, padding_mode="circular"),
        dict(padding="valid", kernel_size=(3, 2), bias=False),
    ],
)
def test_conv_output_error_matches_convolution_outputs(options):
    options = dict(dict(kernel_size=3), **options)
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 16, dtype=torch.float64, **options)
    model = nn.Sequential(conv)
    x = torch.randn(5, 6, 9, 9, dtype=torch.float64)
    reference = copy.deepcopy(conv)
    report = convert(model, num_terms=1, low_rank=2, calibration_data=[x[:2], x[2:]], progress=False)
    with torch.no_grad():
        diff = model[0](x) - reference(x)
        signal = reference(x) - (0 if reference.bias is None else reference.bias[:, None, None])
    assert report.loc[0, "output_error"] == pytest.approx((diff.norm() / signal.norm()).item(), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    fan_in=st.integers(1, 96),
    fan_out=st.integers(1, 96),
    ratio=st.floats(0.01, 1.0),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_param_ratio_budget_is_respected_or_layer_kept_dense(fan_in, fan_out, ratio, bias, dtype):
    model = nn.Sequential(nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype))
    report = convert(model, param_ratio=ratio, progress=False)
    row = report.loc[0]
    config = select_config(fan_in, fan_out, ratio, dtype=dtype, bias=bias)
    if row["status"] == "converted":
        assert isinstance(model[0], SKLinear) and model[0].S1.dtype == dtype
        assert (row["num_terms"], row["low_rank"]) == config
        assert row["stored_params"] <= ratio * row["dense_params"]
        assert row["stored_params"] < row["dense_params"]
    else:
        assert row["status"] == "kept dense" and type(model[0]) is nn.Linear
        assert row["stored_params"] == row["dense_params"]


def test_ranks_are_aligned_for_tensor_cores():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256, dtype=torch.float64))
    report = convert(model, param_ratio=0.25, progress=False)
    assert list(report["low_rank"]) == [12, 15]  # 15 fits; float32 (TF32) wants multiples of 4


# --------------------------------------------------------------------------- selection


def named_model():
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "enc": nn.ModuleDict({"q": nn.Linear(32, 32), "v": nn.Linear(32, 32), "conv": nn.Conv2d(4, 8, 3)}),
            "head": nn.Linear(32, 32),
            "norm": nn.LayerNorm(32),
        }
    )


def converted_names(**kwargs):
    model = named_model()
    report = convert(model, num_terms=1, low_rank=2, progress=False, **kwargs)
    names = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, (SKLinear, SKConv2d)))
    assert names == sorted(report.loc[report["status"] == "converted", "name"])
    return names


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(), ["enc.conv", "enc.q", "enc.v", "head"]),
        (dict(target_modules="all-linear"), ["enc.q", "enc.v", "head"]),
        (dict(target_modules=r"enc\.(q|conv)"), ["enc.conv", "enc.q"]),
        (dict(target_modules=["q", "head"]), ["enc.q", "head"]),
        (dict(target_modules=["enc.v"]), ["enc.v"]),
        (dict(target_modules="all-linear", exclude_modules=["head"]), ["enc.q", "enc.v"]),
        (dict(target_modules=["q", "v"], exclude_modules=r".*\.v"), ["enc.q"]),
        (dict(filter_fn=lambda module, fqn: fqn.startswith("enc") and isinstance(module, nn.Linear)), ["enc.q", "enc.v"]),
    ],
)
def test_selection_follows_peft_semantics(kwargs, expected):
    assert converted_names(**kwargs) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(target_modules="q"),  # a regex must match the whole dotted name
        dict(target_modules=["nc.q"]),  # a list entry must be a dotted suffix
        dict(target_modules="norm"),  # only Linear/Conv2d are candidates
        dict(target_modules="all-linear", exclude_modules=".*"),
        dict(filter_fn=lambda module, fqn: False),
    ],
)
def test_nothing_matched_is_a_clear_error(kwargs):
    model = named_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="matched"):
        convert(model, num_terms=1, low_rank=2, **kwargs)
    assert_unchanged(model, before)


def test_filter_fn_receives_module_and_fqn():
    calls = []
    converted_names(filter_fn=lambda module, fqn: calls.append((type(module), fqn)) or True)
    assert sorted(calls, key=lambda c: c[1]) == [
        (nn.Conv2d, "enc.conv"), (nn.Linear, "enc.q"), (nn.Linear, "enc.v"), (nn.Linear, "head")
    ]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(target_modules=3), TypeError),
        (dict(exclude_modules=[1]), TypeError),
        (dict(filter_fn="yes"), TypeError),
        (dict(target_modules="enc.(q"), ValueError),
        (dict(calibration_data=torch.zeros(2, 32)), TypeError),
        (dict(init="random"), ValueError),
        (dict(seed=1.5), TypeError),
        (dict(calibration_device=0.5), TypeError),
        (dict(calibration_device="warp-drive"), ValueError),
    ],
)
def test_bad_arguments_raise(kwargs, error):
    with pytest.raises(error):
        convert(named_model(), num_terms=1, low_rank=2, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "give a size"),
        (dict(param_ratio=0.5, low_rank=2), "param_ratio chooses low_rank"),
        (dict(num_terms=2), "go together"),
        (dict(low_rank=2), "go together"),
        (dict(param_ratio=0.0), "param_ratio"),
        (dict(param_ratio=1.5), "param_ratio"),
        (dict(num_terms=0, low_rank=2), "num_terms"),
        (dict(param_ratio=0.5, rank_pattern={"q": 2.0}), "rank_pattern"),
        (dict(param_ratio=0.5, rank_pattern={"q": (1, 0)}), "low_rank"),
        (dict(param_ratio=0.5, rank_pattern={"q": (1, 2, 3)}), "pair"),
        (dict(param_ratio=0.5, rank_pattern={"nothing": 0.5}), "matched no selected layer"),
        (dict(param_ratio=0.5, rank_pattern={"(": 0.5}), "regular expression"),
        (dict(rank_pattern={"q": 0.5}), "no default size"),
    ],
)
def test_bad_sizes_raise_value_error_and_change_nothing(kwargs, message):
    model = named_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        convert(model, **kwargs)
    assert_unchanged(model, before)


def test_rank_pattern_sets_sizes_per_layer_and_oversized_layers_stay_dense():
    model = named_model()
    report = convert(
        model,
        num_terms=1,
        low_rank=2,
        rank_pattern={r"q": (2, 3), "head": 0.5, "v": (1, 16)},
        progress=False,
    ).set_index("name")
    assert (model["enc"]["q"].num_terms, model["enc"]["q"].low_rank) == (2, 3)
    assert tuple(report.loc["enc.conv", ["num_terms", "low_rank"]]) == (1, 2)
    assert report.loc["head", "low_rank"] == select_config(32, 32, 0.5)[1]
    assert report.loc["enc.v", "status"] == "kept dense" and type(model["enc"]["v"]) is nn.Linear
    assert "2,080" in report.loc["enc.v", "reason"] and "1,056" in report.loc["enc.v", "reason"]


# --------------------------------------------------------------------------- skipping


def test_mha_out_proj_transformer_fast_path_and_tied_weights_are_skipped():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.block = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
            self.mlp = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 50, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, tokens):
            h = self.embed(tokens)
            h = self.attn(h, h, h, need_weights=False)[0]
            return self.lm_head(self.mlp(self.block(h)))

    torch.manual_seed(0)
    model = Model().eval()
    tokens = torch.randint(0, 50, (2, 7))
    reference = model(tokens)
    report = convert(model, num_terms=1, low_rank=2, progress=False).set_index("name")
    skipped = report[report["status"] == "skipped"]
    assert sorted(skipped.index) == ["attn.out_proj", "block.linear1", "block.linear2", "block.self_attn.out_proj", "lm_head"]
    assert "MultiheadAttention reads out_proj.weight directly" in skipped.loc["attn.out_proj", "reason"]
    assert "TransformerEncoderLayer reads linear1.weight" in skipped.loc["block.linear1", "reason"]
    assert skipped.loc["lm_head", "reason"] == "weight is tied to embed.weight (the same Parameter)"
    assert model.lm_head.weight is model.embed.weight
    assert isinstance(model.mlp, SKLinear) and report.loc["mlp", "status"] == "converted"
    out = model(tokens)  # still runs (fast path included) and only mlp changed
    assert out.shape == reference.shape


def test_subclasses_overriding_forward_are_skipped():
    class Doubled(nn.Linear):
        def forward(self, input):
            return 2 * super().forward(input)

    class Rectified(nn.Conv2d):
        def forward(self, input):
            return super().forward(input).relu()

    class Standardised(nn.Conv2d):
        def _conv_forward(self, input, weight, bias):
            return super()._conv_forward(input, weight / weight.norm(), bias)

    class Renamed(nn.Linear):
        """Inherits nn.Linear.forward: safe to convert."""

    model = nn.ModuleDict({
        "doubled": Doubled(16, 16),
        "rectified": Rectified(4, 8, 3),
        "standardised": Standardised(4, 8, 3),
        "renamed": Renamed(16, 16),
        "mha_style": nn.modules.linear.NonDynamicallyQuantizableLinear(16, 16),
    })
    report = convert(model, num_terms=1, low_rank=2, progress=False).set_index("name")
    assert report.loc["doubled", "reason"] == "Doubled overrides Linear.forward (custom behaviour the sketched layer would drop)"
    assert "Rectified overrides Conv2d.forward" in report.loc["rectified", "reason"]
    assert "Standardised overrides Conv2d._conv_forward" in report.loc["standardised", "reason"]
    assert list(report["status"]) == ["skipped", "skipped", "skipped", "converted", "converted"]
    assert type(model["doubled"]) is Doubled and type(model["rectified"]) is Rectified
    assert isinstance(model["renamed"], SKLinear) and isinstance(model["mha_style"], SKLinear)


def test_grouped_conv_and_root_module_are_skipped():
    model = nn.Sequential(nn.Conv2d(8, 16, 3, groups=2), nn.Conv2d(16, 16, 3))
    report = convert(model, num_terms=1, low_rank=2, progress=False)
    assert list(report["status"]) == ["skipped", "converted"]
    assert "groups=2" in report.loc[0, "reason"]
    root = nn.Linear(64, 64)
    report = convert(root, num_terms=1, low_rank=2, progress=False)
    assert report.loc[0, "status"] == "skipped" and "root module" in report.loc[0, "reason"]


def test_lazy_and_meta_layers_are_skipped():
    model = nn.Sequential(nn.LazyLinear(64), nn.Linear(64, 64))
    report = convert(model, num_terms=1, low_rank=2, progress=False)
    assert list(report["status"]) == ["skipped", "converted"]
    assert "lazy module" in report.loc[0, "reason"]
    assert isinstance(model[0], nn.LazyLinear) and isinstance(model[1], SKLinear)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(8, 16, 3))
    report = convert(model, num_terms=1, low_rank=2, progress=False)
    assert list(report["status"]) == ["skipped", "skipped"]
    assert "meta device" in report.loc[0, "reason"]
    assert [type(m) for m in model] == [nn.Linear, nn.Conv2d]


# --------------------------------------------------------------------------- atomicity & calibration


def assert_unchanged(model, state_before, types_before=None):
    state = model.state_dict()
    assert list(state) == list(state_before)
    for key, value in state_before.items():
        assert torch.equal(state[key], value), key
    if types_before is not None:
        assert [type(m) for m in model.modules()] == types_before


def test_failing_fit_midway_leaves_model_identical(monkeypatch, trained_mlp):
    model = copy.deepcopy(trained_mlp)
    state, types = copy.deepcopy(model.state_dict()), [type(m) for m in model.modules()]
    original = SKLinear.from_linear
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("fit failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(SKLinear, "from_linear", flaky)
    with pytest.raises(RuntimeError, match="fit failed"):
        convert(model, num_terms=1, low_rank=4, progress=False)
    assert_unchanged(model, state, types)


def test_failing_calibration_removes_hooks_and_restores_modes(trained_mlp):
    model = copy.deepcopy(trained_mlp).train()
    model[2].eval()
    modes = [m.training for m in model.modules()]
    state = copy.deepcopy(model.state_dict())
    seen = []

    def batches():
        yield torch.zeros(3, 64, dtype=torch.float64)
        seen.append((torch.is_grad_enabled(), model.training))
        raise RuntimeError("data loader broke")

    with pytest.raises(RuntimeError, match="data loader broke"):
        convert(model, param_ratio=0.25, calibration_data=batches(), progress=False)
    assert seen == [(False, False)]  # calibration runs under no_grad in eval mode
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert [m.training for m in model.modules()] == modes
    assert_unchanged(model, state)


def test_calibration_batch_forms_agree(digits, trained_mlp):
    x = digits[0][:300]

    class Scaled(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, scale=1.0):
            return self.net(x * scale)

    forms = {
        "tensor": [x[:100], x[100:]],
        "tuple": [(x[:100], 1.0), (x[100:],)],
        "dict": [{"x": x[:100]}, {"x": x[100:], "scale": 1.0}],
        "callable": lambda m: m(x),
    }
    errors = {}
    for name, data in forms.items():
        model = Scaled(copy.deepcopy(trained_mlp))
        errors[name] = convert(model, param_ratio=0.25, calibration_data=data, progress=False)["output_error"].to_numpy()
    for name in forms:
        assert errors[name] == pytest.approx(errors["tensor"], rel=1e-9)
    with pytest.raises(TypeError, match="calibration batches"):
        convert(Scaled(copy.deepcopy(trained_mlp)), param_ratio=0.25, calibration_data=[3], progress=False)


class KeywordCalls(nn.Module):
    """A conv and a linear layer called with ``input=`` (keyword) or positionally."""

    def __init__(self, keyword):
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.conv = nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64)
        self.lin = nn.Linear(8 * 25, 16, dtype=torch.float64)

    def forward(self, x):
        h = (self.conv(input=x) if self.keyword else self.conv(x)).relu().flatten(1)
        return self.lin(input=h) if self.keyword else self.lin(h)


def test_calibration_reads_layer_inputs_passed_as_keywords():
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    reports, models = {}, {}
    for keyword in (False, True):
        models[keyword] = KeywordCalls(keyword)
        reports[keyword] = convert(models[keyword], num_terms=1, low_rank=2, calibration_data=[x[:3], x[3:]],
                                   progress=False)
    assert list(reports[True]["init"]) == ["calibrated", "calibrated"]
    assert reports[True]["output_error"].to_numpy() == pytest.approx(reports[False]["output_error"].to_numpy(), rel=1e-12)
    torch.testing.assert_close(models[True](x), models[False](x), rtol=1e-12, atol=1e-12)


CALIBRATION_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("model_device", CALIBRATION_DEVICES)
def test_calibration_device_holds_grams_there_with_the_same_fit(monkeypatch, model_device):
    convert_module = importlib.import_module("panther_lite.convert")
    recorded = []

    class Recording(convert_module._GramRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorded.append(self)

    monkeypatch.setattr(convert_module, "_GramRecorder", Recording)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, device=model_device)
    results = {}
    for calibration_device in (None, "cpu"):
        recorded.clear()
        model = KeywordCalls(keyword=False).to(model_device)
        report = convert(model, num_terms=1, low_rank=2, calibration_data=[x[:3], x[3:]],
                         calibration_device=calibration_device, progress=False)
        expected = torch.device(model_device if calibration_device is None else "cpu").type
        assert [r.gram.device.type for r in recorded] == [expected, expected]
        assert all(r.rows > 0 for r in recorded)
        assert model.lin.S1.device.type == torch.device(model_device).type
        results[calibration_device] = (report["output_error"].to_numpy(), model(x))
    assert results["cpu"][0] == pytest.approx(results[None][0], rel=1e-9)
    torch.testing.assert_close(results["cpu"][1], results[None][1], rtol=1e-9, atol=1e-12)


def test_layer_not_reached_by_calibration_falls_back_with_a_note():
    model = nn.ModuleDict({"used": nn.Linear(32, 32), "unused": nn.Linear(32, 32)}).double()
    with pytest.warns(UserWarning, match="never reached 'unused'"):
        report = convert(model, num_terms=1, low_rank=2, calibration_data=lambda m: m["used"](torch.randn(8, 32).double()),
                         progress=False).set_index("name")
    assert report.loc["used", "init"] == "calibrated" and not math.isnan(report.loc["used", "output_error"])
    assert report.loc["unused", "init"] == "svd" and "never reached" in report.loc["unused", "reason"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_new_modules_keep_dtype_trainability_and_mode(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(4, 32, 3)).to(dtype).train()
    model[0].weight.requires_grad_(False)
    model[1].eval()
    convert(model, num_terms=1, low_rank=4, progress=False)
    sk_linear, sk_conv = model
    assert sk_linear.S1.dtype == sk_linear.U1.dtype == sk_conv.S.dtype == dtype
    assert not sk_linear.S1.requires_grad and not sk_linear.S2.requires_grad and sk_linear.bias.requires_grad
    assert sk_linear.training and not sk_conv.training


def test_progress_bar_can_be_disabled(capsys):
    convert(named_model(), num_terms=1, low_rank=2, progress=True)
    assert "converting" in capsys.readouterr().err
    convert(named_model(), num_terms=1, low_rank=2, progress=False)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- densify & saving


def cnn_mlp_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 64), nn.ReLU(), nn.Linear(64, 64)
    ).double()


def test_densify_round_trip_preserves_outputs():
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=3, init="sketch", seed=0, progress=False)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    sketched_out = model(x)
    assert densify(model) is model
    assert [type(m) for m in model] == [nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]
    torch.testing.assert_close(model(x), sketched_out, rtol=1e-12, atol=1e-12)
    layer = SKLinear(16, 8, 1, 2, dtype=torch.float64)
    dense = densify(layer)
    torch.testing.assert_close(dense(torch.ones(2, 16, dtype=torch.float64)), layer(torch.ones(2, 16, dtype=torch.float64)))


def test_densify_and_apply_conversion_config_keep_shared_layers_shared():
    shared = SKLinear(16, 16, 1, 2, dtype=torch.float64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 16, dtype=torch.float64)
    sketched_out = model(x)
    densify(model)
    assert type(model[0]) is nn.Linear and model[2] is model[0]
    torch.testing.assert_close(model(x), sketched_out)

    sketched = nn.Sequential(shared, nn.ReLU(), shared)
    dense = nn.Linear(16, 16, dtype=torch.float64)
    fresh = nn.Sequential(dense, nn.ReLU(), dense)
    apply_conversion_config(fresh, conversion_config(sketched))
    assert type(fresh[0]) is SKLinear and fresh[2] is fresh[0]
    fresh.load_state_dict(sketched.state_dict())
    torch.testing.assert_close(fresh(x), sketched_out, rtol=0, atol=0)


def test_state_dict_loads_into_fresh_model_with_saved_config(tmp_path):
    model = cnn_mlp_model()
    convert(model, param_ratio=0.3, rank_pattern={"5": (2, 3)}, progress=False)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "conversion.json").write_text(json.dumps(conversion_config(model)))

    fresh = cnn_mlp_model()
    config = json.loads((tmp_path / "conversion.json").read_text())
    assert [(c["name"], c["kind"], c["num_terms"]) for c in config["layers"]] == [
        ("0", "SKConv2d", 1), ("3", "SKLinear", 1), ("5", "SKLinear", 2)
    ]
    apply_conversion_config(fresh, config)
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_apply_conversion_config_mismatch_changes_nothing():
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=2, progress=False)
    config = conversion_config(model)
    other = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 64),
                          nn.ReLU(), nn.Linear(64, 32)).double()
    state, types = copy.deepcopy(other.state_dict()), [type(m) for m in other.modules()]
    with pytest.raises(ValueError, match="'5' has weight shape"):
        apply_conversion_config(other, config)
    assert_unchanged(other, state, types)
    with pytest.raises(ValueError, match="format"):
        apply_conversion_config(other, {"layers": []})


# --------------------------------------------------------------------------- tutorial


def test_compress_model_tutorial_runs_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("compress_model", ROOT / "tutorials" / "compress_model.py")
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    table = tutorial.main(["--quick", "--output-dir", str(tmp_path)])
    assert (tmp_path / "compress_model_digits.png").stat().st_size > 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "compress_model_digits.csv"), table)
    assert set(table["init"]) == {"sketch", "svd", "calibrated"}
