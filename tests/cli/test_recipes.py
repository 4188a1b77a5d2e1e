"""``compress --recipe NAME``: the preset's options as if typed first, every explicit option winning."""
from pathlib import Path

import pytest

from panther_lite.cli import CommandError, build_parser, main
from panther_lite.cli.compress import convert_config
from panther_lite.cli.distilling import check_distill_options
from panther_lite.cli.recipes import RECIPES, expand_recipe

BASE = ["compress", "model", "-o", "out", "--calibration", "text.txt"]


def _parsed(argv):
    namespace = vars(build_parser().parse_args(expand_recipe(argv)))
    namespace.pop("run"), namespace.pop("recipe", None)
    return namespace


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_parses_as_its_options_typed_out(name):
    assert _parsed([*BASE, "--recipe", name]) == _parsed([*BASE, *RECIPES[name]])
    assert _parsed([*BASE, f"--recipe={name}"]) == _parsed([*BASE, *RECIPES[name]])
    assert build_parser().parse_args(expand_recipe([*BASE, "--recipe", name])).recipe == name


def test_explicit_options_win_before_and_after_the_recipe():
    after = _parsed([*BASE, "--recipe", "causal-lm", "--random-tokens", "64", "--allocation", "uniform"])
    before = _parsed([*BASE, "--random-tokens", "64", "--allocation", "uniform", "--recipe", "causal-lm"])
    assert after == before
    assert after["random_tokens"] == 64 and after["allocation"] == "uniform"
    assert after["sensitivity"] == "kl"  # the rest of the recipe stays
    off = _parsed([*BASE, "--recipe", "causal-lm", "--no-distill", "--no-sequential", "--no-output-fisher"])
    assert off["distill"] is False and off["sequential"] is False and off["output_fisher"] is False
    assert off["allocation"] == "global" and after["output_fisher"] is True
    check_distill_options(build_parser().parse_args(expand_recipe([*BASE, "--recipe", "causal-lm", "--no-distill"])))
    with pytest.raises(CommandError, match="add --distill"):  # a typed setting without --distill stays an error
        check_distill_options(build_parser().parse_args([*BASE, "--distill-lr", "1e-4"]))


def test_without_a_recipe_nothing_changes_and_an_unknown_one_is_refused_with_the_choices(capsys):
    assert expand_recipe(BASE) == BASE
    assert expand_recipe([*BASE, "--", "--recipe", "causal-lm"]) == [*BASE, "--", "--recipe", "causal-lm"]
    assert main([*BASE, "--recipe", "causal_lm"]) == 2
    assert "causal-lm" in capsys.readouterr().err


def test_the_command_recommends_the_recipe_for_a_causal_lm_and_runs_it(checkpoints, text_file, tmp_path, capsys):
    """Without ``--recipe`` a causal LM's run names the recipe; with it, the recipe runs (here with a
    short distillation, every step of it exercised) and no hint is printed; an encoder gets none."""
    argv = ["compress", str(checkpoints["llama"]), "--calibration", str(text_file), "--param-ratio", "0.8"]
    assert main([*argv, "-o", str(tmp_path / "plain")]) == 0
    assert "--recipe causal-lm" in capsys.readouterr().err
    assert main([*argv, "-o", str(tmp_path / "recipe"), "--recipe", "causal-lm", "--random-tokens", "8",
                 "--distill-max-steps", "2"]) == 0
    err = capsys.readouterr().err
    assert "--recipe causal-lm (" not in err and "distilled 2 steps" in err
    assert (tmp_path / "recipe" / "distillation.csv").is_file()
    bert = ["compress", str(checkpoints["bert"]), "--calibration", str(text_file), "--param-ratio", "0.8"]
    assert main([*bert, "-o", str(tmp_path / "bert")]) == 0
    assert "--recipe" not in capsys.readouterr().err


def test_across_processes_the_recipe_names_how_to_turn_its_output_fisher_off(monkeypatch):
    """The Fisher is measured in one process: under torchrun the recipe's ``--output-fisher`` is
    refused before any work, naming ``--no-output-fisher``, which then lets the options through."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = [*BASE, "--param-ratio", "0.8", "--recipe", "causal-lm"]
    with pytest.raises(CommandError, match="add --no-output-fisher to compress across processes"):
        convert_config(build_parser().parse_args(expand_recipe(recipe)))
    assert convert_config(build_parser().parse_args(expand_recipe([*recipe, "--no-output-fisher"]))).output_fisher is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert convert_config(build_parser().parse_args(expand_recipe(recipe))).output_fisher is True


@pytest.mark.parametrize("document", ["README.md", "docs/command.rst"])
def test_the_documents_list_the_causal_lm_recipe_as_it_is(document):
    """The README and the command's page say which options the recipe sets: exactly these, in order."""
    text = (Path(__file__).resolve().parents[2] / document).read_text(encoding="utf-8").replace("`", "")
    assert " ".join(RECIPES["causal-lm"]) in " ".join(text.split())
