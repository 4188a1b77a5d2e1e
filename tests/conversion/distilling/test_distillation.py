"""End-to-end distillation of a converted model against the original (panther_lite.distill):
it lowers the held-back loss (MLP, BERT-like hidden states, GPT-2 / LLaMA logits), keeps the
best parameters, leaves the teacher bit for bit as it was and every flag and mode restored
(also after an error mid-training), trains half-precision students in float32 (master weights),
counts only real tokens, and refuses bad settings with the model unchanged."""
from __future__ import annotations

import copy
import functools
import itertools
import math

import pandas as pd
import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.distilling.distillation import RANDOM_TOKEN_LENGTH, DistillationResult, trained_parameters
from panther_lite.conversion.distilling import memory as memory_module
from panther_lite.conversion.distilling import run as run_module
from panther_lite.conversion.distilling.run import Run, warmup_steps
from panther_lite.conversion.distilling.step_budget import StepBudget
from panther_lite.conversion.distilling.objective import relative_squared_error, softened_kl
from panther_lite.conversion.fitting import autocast as autocast_module
from panther_lite.conversion.fitting.autocast import loss_scaler
from panther_lite.nn import SKConv2d, SKLinear

pytestmark = pytest.mark.usefixtures("one_thread")


def dense_mlp(seed=0, dtype=torch.float32):
    """16-64-64-8 with decaying spectra (trained-like: a low rank keeps most of it)."""
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    with torch.no_grad():
        for layer in (mlp[0], mlp[2], mlp[4]):
            u, s, v = torch.linalg.svd(layer.weight, full_matrices=False)
            layer.weight.copy_(2 * u @ torch.diag(s * 0.8 ** torch.arange(len(s))) @ v)
    return mlp.to(dtype)


def inputs(count=8, rows=64, seed=1, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 16, generator=generator).to(dtype) for _ in range(count)]


def student_of(teacher, ratio=0.3):
    """``teacher`` converted at ``ratio`` stored, calibrated on a few rows (so it has room to improve)."""
    model = copy.deepcopy(teacher)
    calibration = [x[:8] for x in inputs(2, seed=9, dtype=next(teacher.parameters()).dtype)]
    panther_lite.convert(model, param_ratio=ratio, calibration_data=calibration, progress=False)
    assert any(isinstance(m, SKLinear) for m in model.modules())
    return model


def output_error(model, teacher, batches):
    with torch.no_grad():
        return sum(float(relative_squared_error(model(x), teacher(x))) for x in batches) / len(batches)


def snapshot(model):
    """Everything distill must leave as it was: values, flags, grads and modes."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(p.requires_grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()],
        [m.training for m in model.modules()],
    )


def assert_same(model, before, values=True):
    state, flags, modes = snapshot(model)
    if values:
        assert state.keys() == before[0].keys()
        for key in state:
            assert torch.equal(state[key], before[0][key]), key
    assert [f for f, _ in flags] == [f for f, _ in before[1]]
    for (_, grad), (_, grad_before) in zip(flags, before[1]):
        assert (grad is None) == (grad_before is None) and (grad is None or torch.equal(grad, grad_before))
    assert modes == before[2]


# ----------------------------------------------------------------------------- it works


def test_distill_lowers_the_held_back_loss_and_the_error_on_fresh_data():
    teacher = dense_mlp()
    model = student_of(teacher)
    fresh = inputs(4, seed=5)
    before = output_error(model, teacher, fresh)
    result = panther_lite.distill(model, teacher, inputs(8), max_steps=150, lr=3e-3, progress=False)
    assert isinstance(result, DistillationResult)
    assert result.loss == "mse" and result.train_batches == 6 and result.held_batches == 2
    assert result.loss_after < 0.7 * result.loss_before
    assert output_error(model, teacher, fresh) < 0.8 * before
    frame = result.history_frame()
    assert frame.columns.tolist() == ["step", "train_loss", "held_loss"]
    assert frame["step"].iloc[0] == 0 and frame["held_loss"].iloc[0] == result.loss_before
    assert frame.set_index("step")["held_loss"][result.best_step] == result.loss_after
    assert frame["train_loss"].iloc[1:].notna().all() and frame["train_loss"].iloc[-1] < frame["train_loss"].iloc[1]


def test_the_held_back_loss_is_the_mean_relative_error_of_the_held_batches():
    teacher = dense_mlp()
    model = student_of(teacher)
    batches = inputs(8)
    result = panther_lite.distill(model, copy.deepcopy(teacher), batches, max_steps=1, progress=False)
    # 8 batches at holdout 0.25: batches 3 and 7 are held back; the loss before is measured on the
    # converted model as it came (restored: one step cannot be judged better unless it is)
    expected = output_error(student_of(teacher), teacher, [batches[3], batches[7]])
    assert result.loss_before == pytest.approx(expected, rel=1e-6)


def test_only_the_selected_parameters_train():
    teacher = dense_mlp()
    for train, trains_bias, trains_norm in ((("factors",), False, False), ("biases", True, False),
                                            (("factors", "norms"), False, True)):
        model = student_of(teacher)
        before = copy.deepcopy(model)
        panther_lite.distill(model, teacher, inputs(8), train=train, max_steps=40, lr=3e-3, progress=False)
        changed = {name for name, p in model.named_parameters() if not torch.equal(p, before.get_parameter(name))}
        assert changed, train
        assert all(name.endswith(("S1", "S2", "bias", "3.weight")) for name in changed)
        assert any(name.endswith(("S1", "S2")) for name in changed) == ("factors" in train)
        assert any(name.endswith(".bias") and not name.startswith("3.") for name in changed) == trains_bias
        assert any(name.startswith("3.") for name in changed) == trains_norm


def test_trained_parameters_finds_conv_factors_and_norms():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 8))
    model[0] = SKConv2d.from_conv2d(model[0], num_terms=1, low_rank=2)
    model[2] = SKLinear.from_linear(model[2], num_terms=1, low_rank=2)
    names = {id(p): n for n, p in model.named_parameters()}
    pick = lambda *train: sorted(names[id(p)] for p in trained_parameters(model, train))
    assert pick("factors") == ["0.S", "2.S1", "2.S2"]
    assert pick("biases") == ["0.bias", "2.bias"]
    assert pick("norms") == ["1.bias", "1.weight"]


def test_a_conv_model_trains_its_factors():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
    model = copy.deepcopy(teacher)
    calibration = [torch.randn(2, 3, 8, 8)]
    panther_lite.convert(model, param_ratio=0.3, calibration_data=calibration, progress=False)
    assert isinstance(model[0], SKConv2d)
    data = [torch.randn(4, 3, 8, 8) for _ in range(6)]
    result = panther_lite.distill(model, teacher, data, max_steps=60, lr=3e-3, progress=False)
    assert result.loss_after < 0.9 * result.loss_before


# ----------------------------------------------------------------------------- never worse, restored


def test_a_run_that_never_improves_restores_every_parameter_bit_for_bit():
    teacher = dense_mlp()
    model = student_of(teacher)
    before = snapshot(model)
    result = panther_lite.distill(model, teacher, inputs(8), lr=50.0, max_steps=30, patience=2, progress=False)
    assert result.best_step == 0 and result.loss_after == result.loss_before
    assert result.stopped_early and result.stop_reason in ("patience", "non-finite loss")
    assert_same(model, before)


def test_a_non_finite_training_loss_stops_and_restores():
    teacher = dense_mlp()
    model = student_of(teacher)
    batches = inputs(8)
    batches[0] = batches[0].clone()
    batches[0][0, 0] = float("nan")  # a training batch (held back: 3 and 7)
    before = snapshot(model)
    result = panther_lite.distill(model, teacher, batches, max_steps=50, eval_every=100, progress=False)
    assert result.stop_reason == "non-finite loss" and result.stopped_early and result.best_step == 0
    assert_same(model, before)


def test_the_teacher_is_left_bit_for_bit_as_it_was():
    teacher = dense_mlp().train()
    teacher[3].eval()  # a mix of modes
    teacher[0].weight.requires_grad_(False)
    teacher[2].bias.grad = torch.ones(64)
    model = student_of(teacher)
    before = snapshot(teacher)
    panther_lite.distill(model, teacher, inputs(8), max_steps=20, lr=3e-3, progress=False)
    assert_same(teacher, before)


def test_modes_flags_and_grads_are_restored_after_success():
    teacher = dense_mlp()
    model = student_of(teacher).train()
    model[1].eval()
    model[0].S1.requires_grad_(False)  # trained anyway (it is selected), frozen again afterwards
    model[4].bias.requires_grad_(False)
    model[2].S2.grad = torch.full_like(model[2].S2, 3.0)
    before = snapshot(model)
    result = panther_lite.distill(model, teacher, inputs(8), max_steps=30, lr=3e-3, progress=False)
    assert result.best_step > 0
    assert_same(model, before, values=False)


class _Interrupt(nn.Module):
    """Identity that raises ``error`` on its ``after``-th training-mode-free call."""

    def __init__(self, after, error):
        super().__init__()
        self.calls, self.after, self.error = 0, after, error

    def forward(self, x):
        self.calls += 1
        if self.calls == self.after:
            raise self.error
        return x


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_error_mid_training_restores_flags_modes_and_the_best_parameters(error):
    teacher = dense_mlp()
    model = student_of(teacher)
    model.append(_Interrupt(after=40, error=error))
    teacher.append(nn.Identity())
    model.train()
    model[0].S1.requires_grad_(False)
    before = snapshot(model)
    with pytest.raises(type(error)):
        panther_lite.distill(model, teacher, inputs(8), max_steps=100, lr=3e-3, eval_every=6, progress=False)
    assert_same(model, before, values=False)
    assert model[5].calls == 40
    # the parameters kept are the best evaluated before the error (the 2 held-back calls of each
    # evaluation and the steps are counted by the interrupting module)
    model[5].after = -1
    assert output_error(model, teacher, [inputs(8)[3], inputs(8)[7]]) < output_error(
        student_of(teacher), teacher, [inputs(8)[3], inputs(8)[7]]
    )


# ----------------------------------------------------------------------------- half precision


def test_bfloat16_updates_accumulate_in_float32_masters():
    teacher = dense_mlp(dtype=torch.bfloat16)
    model = student_of(teacher)
    factor = model[2].S1
    original = factor.detach().clone()
    # Adam moves each entry by about lr = 3e-5 a step: less than a quarter of a bfloat16 unit for
    # entries of magnitude 2^-5 and above, so applied to the parameter itself it is rounded away
    large = original.abs() >= 2**-5
    plain = copy.deepcopy(model)
    optimizer = torch.optim.Adam([p for n, p in plain.named_parameters() if n.endswith(("S1", "S2"))], lr=3e-5)
    for x in inputs(6, dtype=torch.bfloat16) * 5:
        optimizer.zero_grad()
        relative_squared_error(plain(x), teacher(x).detach()).backward()
        optimizer.step()
    assert large.float().mean() > 0.5 and torch.equal(plain[2].S1[large], original[large])
    result = panther_lite.distill(model, teacher, inputs(8, dtype=torch.bfloat16), max_steps=60, eval_every=60,
                                  lr=3e-5, progress=False)
    assert factor.dtype == torch.bfloat16 and result.best_step == 60
    assert (factor[large] != original[large]).float().mean() > 0.2
    assert result.loss_after < result.loss_before


def test_bfloat16_step_matches_a_float32_adam_step_rounded():
    """One step: the student held in float32 (forward, backward and Adam), rounded back."""
    teacher = dense_mlp(dtype=torch.bfloat16)
    model = student_of(teacher)
    batches = inputs(2, dtype=torch.bfloat16)  # batch 1 held back, batch 0 trains
    reference = copy.deepcopy(model).float()
    relative_squared_error(reference(batches[0].float()), teacher(batches[0]).detach()).backward()
    expected = {}
    for name, p in reference.named_parameters():
        if p.grad is not None and name.endswith(("S1", "S2", "bias")) and name[0] != "3":
            torch.optim.Adam([p], lr=1e-3).step()
            expected[name] = p.detach().bfloat16()
    result = panther_lite.distill(model, teacher, batches, max_steps=1, lr=1e-3, progress=False)
    assert result.best_step == 1  # the step lowered the held-back loss, so it was kept
    for name, value in expected.items():
        assert torch.equal(model.get_parameter(name), value), name


def test_float16_trains_in_float32_and_stays_float16():
    teacher = dense_mlp(dtype=torch.float16)
    model = student_of(teacher)
    result = panther_lite.distill(model, teacher, inputs(8, dtype=torch.float16), max_steps=60, lr=3e-3,
                                  progress=False)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert result.loss_after < 0.9 * result.loss_before


# ----------------------------------------------------------------------------- autocast


def test_autocast_runs_the_student_in_bfloat16_and_keeps_float32_parameters():
    teacher = dense_mlp()
    model = student_of(teacher)
    seen = []
    hook = model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    result = panther_lite.distill(model, teacher, inputs(8), max_steps=40, lr=3e-3, autocast="bfloat16",
                                  progress=False)
    hook.remove()
    assert set(seen) == {torch.bfloat16}  # the training steps and the held-back losses alike
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert result.autocast == torch.bfloat16 and result.loss_after < 0.9 * result.loss_before


def _one_step_reference(model, teacher, batch, dtype, scale=1.0):
    """The trained parameters after one Adam step (lr 1e-3) on the gradient of ``model``'s
    forward under autocast in ``dtype``, its loss scaled by ``scale`` and the gradient unscaled."""
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype):
        output = reference(batch)
    (relative_squared_error(output, teacher(batch).detach()) * scale).backward()
    expected = {}
    for name, p in reference.named_parameters():
        if p.grad is not None and name.endswith(("S1", "S2", "bias")) and name[0] != "3":
            p.grad /= scale
            torch.optim.Adam([p], lr=1e-3).step()
            expected[name] = p.detach()
    return expected


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1.0), (torch.float16, 2.0 ** 16)])
def test_an_autocast_step_is_adam_on_the_gradient_of_the_autocast_forward(dtype, scale):
    """bfloat16 unscaled; float16 through GradScaler's first scale (2^16), unscaled before Adam."""
    teacher = dense_mlp()
    model = student_of(teacher)
    batches = inputs(2)  # batch 1 held back, batch 0 trains
    expected = _one_step_reference(model, teacher, batches[0], dtype, scale)
    result = panther_lite.distill(model, teacher, batches, max_steps=1, lr=1e-3, autocast=dtype, progress=False)
    assert result.best_step == 1 and result.autocast == dtype
    for name, value in expected.items():
        torch.testing.assert_close(model.get_parameter(name), value, rtol=1e-6, atol=1e-7, msg=name)


def test_float16_autocast_trains_through_its_loss_scaler(monkeypatch):
    scaling = []
    real_scale = torch.amp.GradScaler.scale
    monkeypatch.setattr(torch.amp.GradScaler, "scale",
                        lambda self, outputs: scaling.append(self.is_enabled()) or real_scale(self, outputs))
    teacher = dense_mlp()
    model = student_of(teacher)
    result = panther_lite.distill(model, teacher, inputs(8), max_steps=60, lr=3e-3, autocast="float16", progress=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert result.loss_after < 0.9 * result.loss_before
    assert len(scaling) == 60 and all(scaling)  # every step's loss scaled
    assert not loss_scaler(torch.bfloat16, torch.device("cpu")).is_enabled()


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_autocast_is_bfloat16_where_the_device_computes_it_natively(monkeypatch, native, expected):
    monkeypatch.setattr(autocast_module, "native_bfloat16", lambda device: native)
    teacher = dense_mlp()
    result = panther_lite.distill(student_of(teacher), teacher, inputs(4), max_steps=2, autocast="auto",
                                  progress=False)
    assert result.autocast == expected


def test_native_bfloat16_is_false_where_it_would_be_emulated():
    assert autocast_module.native_bfloat16(torch.device("meta")) is False
    assert isinstance(autocast_module.native_bfloat16(torch.device("cpu")), bool)


# ----------------------------------------------------------------------------- losses and outputs


def test_softened_kl_and_relative_error_match_their_formulas():
    torch.manual_seed(0)
    s, t = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    temperature = 2.5
    p = torch.softmax(t / temperature, -1)
    reference = (p * (p.log() - torch.log_softmax(s / temperature, -1))).sum(-1).mean() * temperature**2
    torch.testing.assert_close(softened_kl(s, t, temperature), reference, rtol=1e-12, atol=0)
    torch.testing.assert_close(relative_squared_error(s, t), (s - t).square().sum() / t.square().sum(), rtol=1e-12, atol=0)
    assert softened_kl(t, t, temperature) == 0


class _Wrapped(nn.Module):
    """A model returning a dict (``logits`` or ``last_hidden_state``), a tuple or an object."""

    def __init__(self, inner, style):
        super().__init__()
        self.inner, self.style = inner, style

    def forward(self, x):
        y = self.inner(x)
        if self.style == "tuple":
            return (y, "not a tensor")
        return {self.style: y, "other": y * 0}


@pytest.mark.parametrize(
    "style, outputs, loss, expected",
    [
        ("logits", None, "auto", "kl"),
        ("last_hidden_state", None, "auto", "mse"),
        ("tuple", None, "auto", "mse"),
        ("tuple", 0, "kl", "kl"),
        ("logits", "logits", "mse", "mse"),
        ("logits", lambda out: out["logits"] * 2, "auto", "mse"),
    ],
)
def test_outputs_and_loss_are_chosen_by_the_output(style, outputs, loss, expected):
    teacher = _Wrapped(dense_mlp(), style)
    model = _Wrapped(student_of(teacher.inner), style)
    result = panther_lite.distill(model, teacher, inputs(8), outputs=outputs, loss=loss, max_steps=40, lr=3e-3,
                                  progress=False)
    assert result.loss == expected
    assert result.loss_after < result.loss_before


def test_a_callable_loss_receives_the_selected_outputs():
    teacher = dense_mlp()
    model = student_of(teacher)
    seen = []

    def l1(student, teacher_output):
        seen.append((student.shape, teacher_output.requires_grad))
        return (student - teacher_output).abs().mean()

    result = panther_lite.distill(model, teacher, inputs(8), loss=l1, max_steps=20, lr=3e-3, progress=False)
    assert result.loss == "callable" and result.loss_after < result.loss_before
    assert seen and all(shape == (64, 8) and not grad for shape, grad in seen)


# ----------------------------------------------------------------------------- bad settings


def _bad_settings():
    teacher = dense_mlp()
    other = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 9))
    data = inputs(4)
    return teacher, [
        (dict(teacher="self"), ValueError, "same module"),
        (dict(model=lambda t: copy.deepcopy(t)), ValueError, "no sketched layer"),
        (dict(teacher=other), ValueError, r"output \(64, 8\) and the teacher's \(64, 9\)"),
        (dict(lr=0), ValueError, "lr must be a positive"),
        (dict(lr=-1e-3), ValueError, "lr must be a positive"),
        (dict(lr=float("nan")), ValueError, "lr must be a positive"),
        (dict(holdout=1.0), ValueError, "holdout"),
        (dict(max_steps=0), ValueError, "max_steps"),
        (dict(max_minutes=0), ValueError, "max_minutes must be a finite number of minutes > 0 or None, got 0"),
        (dict(max_minutes=float("inf")), ValueError, "max_minutes must be"),
        (dict(max_minutes="5"), ValueError, "max_minutes must be"),
        (dict(max_minutes=True), ValueError, "max_minutes must be"),
        (dict(patience=0), ValueError, "patience"),
        (dict(eval_every=0), ValueError, "eval_every"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(data=[]), ValueError, "data holds 0 batch"),
        (dict(data=data[:1]), ValueError, "at least 2"),
        (dict(data=torch.randn(8, 16)), TypeError, "single Tensor"),
        (dict(data=lambda m: m(data[0])), TypeError, "iterable of batches"),
        (dict(data=[data[0], None]), TypeError, "batch 1 is NoneType"),
        (dict(train=("weights",)), ValueError, "train must name"),
        (dict(train=()), ValueError, "train must name"),
        (dict(train=5), TypeError, "train must be"),
        (dict(loss="l1"), ValueError, "loss must be one of"),
        (dict(loss=lambda s, t: 1.0), TypeError, "scalar Tensor"),
        (dict(temperature=0), ValueError, "temperature"),
        (dict(schedule="linear"), ValueError, "schedule must be one of"),
        (dict(outputs=1.5), TypeError, "outputs must be"),
        (dict(outputs="logits"), ValueError, "selects nothing"),
        (dict(outputs=3), ValueError, "selects nothing"),
        (dict(random_tokens=4), ValueError, "needs tokenizer"),
        (dict(random_tokens=-1), ValueError, "random_tokens"),
        (dict(random_token_length=0), ValueError, "random_token_length"),
        (dict(autocast="int8"), ValueError, "autocast must be None, 'auto', torch.bfloat16 or torch.float16"),
        (dict(autocast=torch.float64), ValueError, "autocast must be"),
        (dict(data=[d.double() for d in data]), RuntimeError, "dtype"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_settings()[1])))
def test_bad_settings_are_named_and_change_nothing(case):
    teacher, cases = _bad_settings()
    overrides, error, message = cases[case]
    model = student_of(teacher).train()
    model[0].S1.requires_grad_(False)
    kwargs = dict(model=model, teacher=teacher, data=inputs(4), progress=False)
    kwargs.update(overrides)
    if kwargs["teacher"] == "self":
        kwargs["teacher"] = model
    if callable(kwargs["model"]) and not isinstance(kwargs["model"], nn.Module):
        kwargs["model"] = model = kwargs["model"](teacher)
    before, teacher_before = snapshot(model), snapshot(teacher)
    with pytest.raises(error, match=message):
        panther_lite.distill(kwargs.pop("model"), kwargs.pop("teacher"), kwargs.pop("data"), **kwargs)
    assert_same(model, before)
    assert_same(teacher, teacher_before)


def test_a_model_this_machines_memory_cannot_train_is_refused_before_anything_changes(monkeypatch):
    teacher = dense_mlp()
    model = student_of(teacher)
    elements = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers()))
    trained = sum(p.numel() for p in trained_parameters(model, ("factors", "biases")))
    needed = 4 * elements + 16 * trained  # float32 model; best copy, gradient, Adam's two moments per trained
    monkeypatch.setattr(memory_module, "physical_memory", lambda: needed - 1)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"distill: training this model needs at least .* \(its {elements:,} elements in "
                                         rf"float32; for the {trained:,} that train, .*more memory, or a GPU"):
        panther_lite.distill(model, teacher, inputs(4), max_steps=2, progress=False)
    assert_same(model, before)
    monkeypatch.setattr(memory_module, "physical_memory", lambda: needed)  # exactly enough: it trains
    assert panther_lite.distill(model, teacher, inputs(4), max_steps=2, progress=False).steps == 2


def test_trained_parameters_shared_with_the_teacher_are_refused():
    teacher = dense_mlp()
    model = student_of(teacher)
    teacher[4] = model[4]  # a sketched layer in both
    before = snapshot(model)
    with pytest.raises(ValueError, match="shares tensors"):
        panther_lite.distill(model, teacher, inputs(4), progress=False)
    assert_same(model, before)


def test_a_half_precision_student_sharing_untrained_tensors_with_the_teacher_is_refused():
    """Held in float32 while it trains, the student would widen the teacher's shared norm too."""
    teacher = dense_mlp(dtype=torch.bfloat16)
    model = student_of(teacher)
    model[3] = teacher[3]  # the LayerNorm, not trained under the default train=("factors", "biases")
    before, teacher_before = snapshot(model), snapshot(teacher)
    with pytest.raises(ValueError, match="shares tensors"):
        panther_lite.distill(model, teacher, inputs(4, dtype=torch.bfloat16), progress=False)
    assert_same(model, before)
    assert_same(teacher, teacher_before)


def test_a_data_loader_and_a_progress_bar_work(capsys):
    teacher = dense_mlp()
    model = student_of(teacher)
    loader = torch.utils.data.DataLoader(torch.cat(inputs(4)), batch_size=32)
    result = panther_lite.distill(model, teacher, loader, max_steps=12, progress=True)
    assert result.train_batches + result.held_batches == 8
    assert "distilling" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Hugging Face models

VOCAB, HIDDEN, SEQ = 64, 32, 12


def _token_batches(count, seed=3, pad=True):
    """``count`` dict batches of 4 rows of ``SEQ`` tokens, rows padded at the end (mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(5, VOCAB, (4, SEQ), generator=generator)
        mask = torch.ones(4, SEQ, dtype=torch.long)
        if pad:
            for row, length in enumerate((SEQ, 9, 6, 4)):
                mask[row, length:] = 0
        batches.append(dict(input_ids=ids, attention_mask=mask))
    return batches


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
    if name == "bert":
        config = transformers.BertConfig(hidden_size=HIDDEN, intermediate_size=64, max_position_embeddings=SEQ, **common)
        return transformers.BertModel(config, add_pooling_layer=False).eval()
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=SEQ)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_key_value_heads=2,
                                      max_position_embeddings=SEQ, **common)
    return transformers.LlamaForCausalLM(config).eval()


def _hf_student(teacher):
    model = copy.deepcopy(teacher)
    panther_lite.convert(model, target_modules="all-linear", exclude_modules="lm_head", param_ratio=0.3,
                         calibration_data=_token_batches(1, seed=11), progress=False)
    return model


# the conversion leaves the random tiny LLaMA's logits within 0.0014 of the teacher's (KL): less to gain
@pytest.mark.parametrize("name, loss, gain", [("bert", "mse", 0.8), ("gpt2", "kl", 0.8), ("llama", "kl", 0.95)])
def test_hugging_face_models_distil_their_hidden_states_or_logits(name, loss, gain):
    teacher = _hf(name)
    model = _hf_student(teacher)
    before = snapshot(teacher)
    result = panther_lite.distill(model, teacher, _token_batches(8), max_steps=80, lr=3e-3, progress=False)
    assert result.loss == loss
    assert result.loss_after < gain * result.loss_before
    assert_same(teacher, before)


def test_padded_positions_do_not_count():
    teacher = _hf("bert")
    model = _hf_student(teacher)
    batches = _token_batches(4)
    other = [dict(b, input_ids=torch.where(b["attention_mask"].bool(), b["input_ids"], (b["input_ids"] + 7) % VOCAB))
             for b in batches]
    with torch.no_grad():  # the padded positions' outputs do change, so counting them would change the loss
        padded = ~batches[3]["attention_mask"].bool()
        change = model(**batches[3]).last_hidden_state[padded] - model(**other[3]).last_hidden_state[padded]
    assert change.abs().max() > 1e-2
    losses = [panther_lite.distill(copy.deepcopy(model), teacher, data, max_steps=1, progress=False).loss_before
              for data in (batches, other)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)
    # and the loss is the relative error at the real tokens
    held = batches[3]  # 4 batches at holdout 0.25: the last one is held back
    real = held["attention_mask"].bool()
    with torch.no_grad():
        expected = relative_squared_error(model(**held).last_hidden_state[real], teacher(**held).last_hidden_state[real])
    assert losses[0] == pytest.approx(float(expected), rel=1e-6)


def test_random_token_batches_are_added_with_the_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate(special + [f"w{i}" for i in range(VOCAB - len(special))])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    teacher = _hf("llama")
    model = _hf_student(teacher)
    seen = []
    model.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    result = panther_lite.distill(model, teacher, _token_batches(2), tokenizer=tokenizer, random_tokens=64,
                                  max_steps=9, eval_every=3, progress=False)
    # 2 data batches and 64 sequences in 2 batches of 32; batch 3 (random tokens) is held back
    assert (result.train_batches, result.held_batches, result.steps) == (3, 1, 9)
    random_rows = [ids for ids in seen if ids.shape[0] == 32]
    held = random_rows[0]  # the first evaluation, before training
    length = RANDOM_TOKEN_LENGTH  # distill's default, not random_token_batches'
    assert torch.equal(held, panther_lite.random_token_batches(tokenizer, 64, length)[1]["input_ids"])
    trained = [ids for ids in random_rows if not torch.equal(ids, held)]
    assert len(random_rows) - len(trained) == 4  # the held-back batch at each of the 4 evaluations
    assert len(trained) == 3  # one random training batch per pass of 3 steps, a fresh draw each pass
    assert all(not torch.equal(a, b) for i, a in enumerate(trained) for b in trained[:i])
    assert torch.equal(trained[0], panther_lite.random_token_batches(tokenizer, 64, length)[0]["input_ids"])
    assert torch.equal(trained[1], panther_lite.random_token_batches(tokenizer, 64, length, seed=1)[0]["input_ids"])


def test_the_teacher_runs_in_eval_mode_without_dropout():
    teacher = dense_mlp()
    model = student_of(teacher)
    teacher.insert(2, nn.Dropout(0.5))
    model.insert(2, nn.Dropout(0.5))
    teacher.train()
    model.train()
    batches = inputs(8)
    expected = output_error(model.eval(), teacher.eval(), [batches[3], batches[7]])
    teacher.train()
    model.train()
    result = panther_lite.distill(model, teacher, batches, max_steps=1, progress=False)
    assert result.loss_before == pytest.approx(expected, rel=1e-6)
    assert teacher.training and model.training


def test_patience_counts_only_evaluations_after_the_warm_up():
    run = Run(best_loss=1.0, warmup=20)
    best, parameters = [torch.zeros(1)], [torch.ones(1)]
    for step in range(5, 21, 5):  # worse at every evaluation inside the warm-up: no stop
        run.steps = step
        run.train_losses.append(1.0)
        assert run.evaluated(2.0, parameters, best, patience=2)
    for step, keeps_going in ((25, True), (30, False)):
        run.steps = step
        run.train_losses.append(1.0)
        assert run.evaluated(2.0, parameters, best, patience=2) is keeps_going
    assert run.stop_reason == "patience" and run.best_step == 0 and float(best[0]) == 0.0


def test_a_run_without_gain_goes_on_to_the_end_of_the_warm_up():
    teacher = dense_mlp()
    model = student_of(teacher)
    result = panther_lite.distill(model, teacher, inputs(8), lr=1.0, max_steps=400, eval_every=1, patience=2,
                                  progress=False)
    assert result.best_step == 0 and result.stop_reason == "patience"
    assert result.steps == warmup_steps(400) + 2


# ----------------------------------------------------------------------------- a time limit (max_minutes)
# The steps are timed on a fake clock: only those that fit are taken, the schedule decays to 0 at the
# last of them, and a limit that holds every step changes nothing.

class FakeTime:
    """A clock that moves only when told: ``step_seconds`` per training step, ``evaluation_seconds``
    per held-back evaluation; records the learning rate of every step."""

    def __init__(self, monkeypatch, step_seconds: float, evaluation_seconds: float = 0.0) -> None:
        self.now, self.rates = 0.0, []
        real_step, real_held = run_module._step, run_module.Session.held_loss

        def step(session, index, optimizer, scaler):
            self.rates.append(optimizer.param_groups[0]["lr"])
            self.now += step_seconds
            return real_step(session, index, optimizer, scaler)

        def held_loss(session):
            self.now += evaluation_seconds
            return real_held(session)

        monkeypatch.setattr(run_module, "_step", step)
        monkeypatch.setattr(run_module.Session, "held_loss", held_loss)
        monkeypatch.setattr(run_module, "StepBudget", functools.partial(StepBudget, clock=lambda: self.now))


def _distilled(**settings):
    teacher = dense_mlp()
    model = student_of(teacher)
    result = panther_lite.distill(model, teacher, inputs(8), lr=1e-3, patience=1000, progress=False, **settings)
    return model, result


def test_a_time_limit_takes_the_steps_that_fit_and_decays_the_rate_to_their_end(monkeypatch):
    clock = FakeTime(monkeypatch, step_seconds=1.0)
    _, result = _distilled(max_steps=100, max_minutes=0.5, eval_every=10)
    assert (result.steps, result.stop_reason, result.stopped_early) == (30, "max_minutes", True)
    warmup = warmup_steps(100)  # planned at its end: 1 s a step, 30 steps in half a minute
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (30 - warmup))) for step in range(warmup, 30)]
    assert clock.rates[warmup:] == pytest.approx(cosine, rel=1e-9, abs=1e-15)
    assert clock.rates[-1] < 0.01 * 1e-3 and clock.now == 30.0


def test_the_held_back_evaluations_count_against_the_limit(monkeypatch):
    clock = FakeTime(monkeypatch, step_seconds=1.0, evaluation_seconds=10.0)
    _, result = _distilled(max_steps=100, max_minutes=1, eval_every=5)
    assert (result.steps, result.stop_reason) == (20, "max_minutes")  # 20 steps and 4 evaluations: a minute
    assert [step for step, _, _ in result.history] == [0, 5, 10, 15, 20]
    assert clock.now == 70.0  # the evaluation before training (step 0) is not the training loop's


def test_a_limit_every_step_fits_in_changes_nothing():
    limited, limited_result = _distilled(max_steps=12, max_minutes=10_000, eval_every=4)
    plain, plain_result = _distilled(max_steps=12, eval_every=4)
    assert (limited_result.steps, limited_result.stop_reason, limited_result.stopped_early) == (12, "max_steps", False)
    assert limited_result.history == plain_result.history
    for mine, theirs in zip(limited.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(mine, theirs)
