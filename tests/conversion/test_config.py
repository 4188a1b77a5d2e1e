"""ConvertConfig: every convert option in one frozen dataclass, validated once when made;
keywords and a config give the same model bit for bit; overrides replace a config's fields;
an unknown option names the closest one; tune varies a config."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite import ConvertConfig, RefineConfig
from panther_lite.conversion.config import make_config


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 8))


def batches():
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(64, 24, generator=generator) for _ in range(2)]


def _same_model_and_report(first, second, report_a, report_b):
    state_a, state_b = first.state_dict(), second.state_dict()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert report_a.equals(report_b)


@pytest.mark.parametrize(
    "options",
    [
        dict(param_ratio=0.4, seed=0),
        dict(param_ratio=0.3, allocation="global", sequential=True),
        dict(num_terms=2, low_rank=3, init="sketch", seed=5),
        dict(param_ratio=0.5, rank_pattern={"2": (1, 2)}, decomposition="randomized", seed=1),
    ],
)
def test_keywords_and_a_config_give_the_same_model_bit_for_bit(options):
    by_keywords, by_config = mlp(), mlp()
    report_a = panther_lite.convert(by_keywords, calibration_data=batches(), progress=False, **options)
    report_b = panther_lite.convert(by_config, ConvertConfig(progress=False, **options), calibration_data=batches())
    _same_model_and_report(by_keywords, by_config, report_a, report_b)
    assert report_b.attrs["config"] == ConvertConfig(progress=False, **options)


def test_overrides_replace_the_configs_fields():
    config = ConvertConfig(param_ratio=0.9, allocation="global", progress=False)
    first, second = mlp(), mlp()
    report_a = panther_lite.convert(first, config, calibration_data=batches(), param_ratio=0.3)
    replaced = dataclasses.replace(config, param_ratio=0.3)
    report_b = panther_lite.convert(second, replaced, calibration_data=batches())
    _same_model_and_report(first, second, report_a, report_b)
    assert report_a.attrs["config"] == replaced and config.param_ratio == 0.9


def test_an_unknown_option_names_the_closest_valid_one_and_nothing_changes():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"unknown option 'param_ration'; did you mean 'param_ratio'\?"):
        panther_lite.convert(model, param_ration=0.5)
    with pytest.raises(TypeError, match=r"unknown option 'sizes'"):
        panther_lite.convert(model, ConvertConfig(param_ratio=0.5), sizes=None)
    with pytest.raises(TypeError, match="config must be a panther_lite.ConvertConfig"):
        panther_lite.convert(model, {"param_ratio": 0.5})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(), ValueError, "give a size"),
        (dict(param_ratio=1.5), ValueError, r"param_ratio must be a number in \(0, 1\]"),
        (dict(param_ratio=0.5, init="random"), ValueError, "init must be one of"),
        (dict(param_ratio=0.5, allocation="best"), ValueError, "allocation must be one of"),
        (dict(num_terms=1, low_rank=2, allocation="global"), ValueError, "allocation='global' spreads one budget"),
        (dict(param_ratio=0.5, sequential=1), TypeError, "sequential must be True or False"),
        (dict(param_ratio=0.5, sequential=True, init="sketch"), ValueError, "needs init='svd'"),
        (dict(param_ratio=0.5, output_fisher="yes"), TypeError, "output_fisher must be True or False"),
        (dict(param_ratio=0.5, output_fisher=True, init="sketch"), ValueError, "output_fisher=True .* needs init='svd'"),
        (dict(param_ratio=0.5, align=0), ValueError, "align must be"),
        (dict(param_ratio=0.5, calibration_device="meta"), ValueError, "calibration_device='meta'"),
        (dict(param_ratio=0.5, blocks=3), TypeError, "blocks must be"),
        (dict(param_ratio=0.5, refine={"steps": 3}), ValueError, r"refine: unknown setting\(s\) \['steps'\]"),
        (dict(param_ratio=0.5, refine={"lr": -1}), ValueError, "refine: lr must be a positive finite number"),
        (dict(param_ratio=0.5, target_modules="("), ValueError, "not a valid regular expression"),
        (dict(param_ratio=0.5, seed=1.5), TypeError, "seed must be an int"),
    ],
)
def test_bad_options_are_refused_when_the_config_is_made(options, error, match):
    with pytest.raises(error, match=match):
        ConvertConfig(**options)


def test_the_config_is_frozen_and_normalised():
    config = ConvertConfig(param_ratio=0.5, calibration_device="cpu", refine=True, rank_pattern={"0": 0.2})
    assert config.calibration_device == torch.device("cpu") and config.cache_device == torch.device("cpu")
    assert config.refine == RefineConfig() and ConvertConfig(param_ratio=0.5).refine is None
    assert ConvertConfig(param_ratio=0.5, refine={"max_steps": 3}).refine == RefineConfig(max_steps=3)
    assert config.sizes.default == 0.5 and config.sizes.patterns[0][1] == "0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.param_ratio = 0.1
    assert dataclasses.replace(config, param_ratio=0.25).sizes.default == 0.25


def test_tune_varies_a_config():
    x = batches()

    def evaluate(model):
        return -float(nn.functional.mse_loss(model(x[0]), reference))

    reference = mlp()(x[0]).detach()
    config = ConvertConfig(param_ratio=1.0, allocation="global", num_terms=1, progress=False)
    report = panther_lite.tune(mlp(), evaluate, tolerance=0.05, calibration_data=x, config=config, max_evaluations=3)
    assert report.attrs["config"] == dataclasses.replace(config, param_ratio=report.attrs["tune_budget"])
    with pytest.raises(ValueError, match=r"tune chooses the budget itself: drop \['low_rank'\]"):
        panther_lite.tune(mlp(), evaluate, tolerance=0.05, config=ConvertConfig(num_terms=1, low_rank=2))


def test_a_calibration_device_this_machine_lacks_is_named_before_anything_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"calibration_device 'cuda': cuda is not available on this machine"):
        ConvertConfig(param_ratio=0.5, calibration_device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"calibration_device 'cuda:3': this machine has 1 cuda device"):
        ConvertConfig(param_ratio=0.5, calibration_device="cuda:3")
    assert ConvertConfig(param_ratio=0.5, calibration_device="cuda:0").calibration_device == torch.device("cuda:0")


def test_the_deprecated_fit_option_still_names_the_decomposition():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ConvertConfig(param_ratio=0.5, fit="exact")
        overridden = make_config(config, {"fit": "randomized"})
    assert config.decomposition == "exact" and overridden.decomposition == "randomized"
    assert sum(issubclass(w.category, DeprecationWarning) for w in caught) == 2
