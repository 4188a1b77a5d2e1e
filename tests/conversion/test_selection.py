"""Selection: PEFT-style target/exclude matching, filter_fn, argument checks and skip reasons."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

from panther_lite import convert
from panther_lite.nn import SKConv2d, SKLinear


def converted_names(model, **kwargs):
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
def test_selection_follows_peft_semantics(kwargs, expected, named_model):
    assert converted_names(named_model(), **kwargs) == expected


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
def test_nothing_matched_is_a_clear_error(kwargs, named_model, assert_unchanged):
    model = named_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="matched"):
        convert(model, num_terms=1, low_rank=2, **kwargs)
    assert_unchanged(model, before)


def test_filter_fn_receives_module_and_fqn(named_model):
    calls = []
    converted_names(named_model(), filter_fn=lambda module, fqn: calls.append((type(module), fqn)) or True)
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
def test_bad_arguments_raise(kwargs, error, named_model):
    with pytest.raises(error):
        convert(named_model(), num_terms=1, low_rank=2, **kwargs)


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
    assert report.loc["doubled", "reason"].startswith(
        "Doubled overrides Linear.forward (custom behaviour the sketched layer would drop): its forward differs from "
        "x·Wᵀ + b on probe inputs"
    )
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


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(target_modules=["q", "qq", "head"]), "target_modules entries ['qq']"),
        (dict(target_modules=["enc.q", "norm"]), "target_modules entries ['norm']"),  # not a candidate kind
        (dict(target_modules="all-linear", exclude_modules=["hed"]), "exclude_modules entries ['hed']"),
    ],
)
def test_a_list_entry_matching_nothing_is_an_error_naming_it(kwargs, named, named_model, assert_unchanged):
    model = named_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=re.escape(named)):
        convert(model, num_terms=1, low_rank=2, **kwargs)
    assert_unchanged(model, before)


def test_a_module_shared_at_two_places_converts_once_and_stays_shared():
    shared = nn.Linear(32, 32, dtype=torch.float64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = convert(model, num_terms=1, low_rank=2, progress=False)
    assert list(report["name"]) == ["0"] and report.loc[0, "status"] == "converted"
    assert isinstance(model[0], SKLinear) and model[2] is model[0]


@pytest.mark.parametrize("tied", [True, False])
def test_llama_head_tied_to_the_embedding_is_skipped_naming_the_owner(tied):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (2, 5))
    report = convert(model, num_terms=1, low_rank=2, example_inputs=tokens, progress=False).set_index("name")
    head = report.loc["lm_head"]
    if tied:
        assert head["status"] == "skipped"
        assert head["reason"] == "weight is tied to model.embed_tokens.weight (the same Parameter)"
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert head["status"] == "converted" and isinstance(model.lm_head, SKLinear)
    assert (report.drop(index="lm_head")["status"] == "converted").all()
    assert model(tokens).logits.shape == (2, 5, 64)
