"""Planning: sizes per layer from num_terms/low_rank, param_ratio and rank_pattern."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from panther_lite import convert
from panther_lite.nn import select_config


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
def test_bad_sizes_raise_value_error_and_change_nothing(kwargs, message, named_model, assert_unchanged):
    model = named_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        convert(model, **kwargs)
    assert_unchanged(model, before)


def test_rank_pattern_sets_sizes_per_layer_and_oversized_layers_stay_dense(named_model):
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
