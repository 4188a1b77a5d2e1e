"""The command's config options are generated from the config dataclasses: every field the command
offers has its option, named after the field, with the field's documentation and default as help,
and an unset option leaves the config's default."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from panther_lite import ConvertConfig, DistillConfig, RefineConfig
from panther_lite.cli import build_parser
from panther_lite.cli.compress import CONVERT_OPTIONS, REFINE_OPTIONS
from panther_lite.cli.config_options import Option, add_config_options, config_overrides, field_docs
from panther_lite.cli.distilling import DISTILL_OPTIONS


@pytest.mark.parametrize("config_class", [ConvertConfig, RefineConfig, DistillConfig])
def test_every_field_is_documented(config_class):
    docs = field_docs(config_class)
    assert set(docs) == {f.name for f in dataclasses.fields(config_class) if f.init}
    assert all(text and "``" not in text for text in docs.values())


def _compress_help() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(commands.choices["compress"].format_help().split())


@pytest.mark.parametrize("config_class, options, prefix", [
    (ConvertConfig, CONVERT_OPTIONS, ""), (RefineConfig, REFINE_OPTIONS, "refine-"),
    (DistillConfig, DISTILL_OPTIONS, "distill-"),
])
def test_the_command_offers_the_fields_with_their_docs(config_class, options, prefix):
    text, docs = _compress_help(), field_docs(config_class)
    for option in options:
        assert f"--{prefix}{option.field}".replace("_", "-") in text
        assert " ".join(docs[option.field].split()[:6]) in text


def test_unset_options_leave_the_config_defaults_and_set_ones_override():
    parser = argparse.ArgumentParser()
    options = (Option("max_steps", int, aliases=("--steps",)), Option("lr", float))
    add_config_options(parser, RefineConfig, options, prefix="refine-")
    assert config_overrides(parser.parse_args([]), options, prefix="refine-") == {}
    args = parser.parse_args(["--steps", "5"])
    assert config_overrides(args, options, prefix="refine-") == {"max_steps": 5}
    assert RefineConfig(**config_overrides(args, options, prefix="refine-")).max_steps == 5
