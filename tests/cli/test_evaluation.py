"""``compress --eval``: the original's and the compressed model's perplexity, streamed, in the
summary, evaluation.csv and the report figure, equal to panther_lite.perplexity; bad options
end in one message before anything is written."""
from __future__ import annotations

import pandas as pd
import pytest

import panther_lite
from panther_lite.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


def _argv(model_dir, text_file, output, *extra):
    return ["compress", str(model_dir), "--calibration", str(text_file), "--output", str(output),
            "--param-ratio", "0.5", "--quiet", *extra]


def test_eval_reports_both_perplexities_as_perplexity_measures_them(checkpoints, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_argv(checkpoints["llama"], text_file, out, "--eval", str(text_file), "--eval-seq-len", "8")) == 0
    rows = pd.read_csv(out / "evaluation.csv").set_index("model")
    original = panther_lite.perplexity(checkpoints["llama"], text_file, seq_len=8, progress=False)
    compressed = transformers.AutoTokenizer.from_pretrained(str(out))
    loaded = panther_lite.from_pretrained(transformers.AutoModelForCausalLM, out)
    expected = panther_lite.perplexity(loaded, text_file, tokenizer=compressed, seq_len=8, progress=False)
    assert rows.loc["original", "perplexity"] == pytest.approx(float(original), rel=1e-9)
    assert rows.loc["compressed", "perplexity"] == pytest.approx(float(expected), rel=1e-6)
    assert rows.loc["compressed", "tokens"] == expected.tokens and rows.loc["compressed", "seq_len"] == 8
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith(f"perplexity on {text_file.name}: original {float(original):.3f}, compressed ")
    assert (out / "report.png").stat().st_size > 0


def test_no_eval_original_measures_the_compressed_model_alone(checkpoints, text_file, tmp_path):
    out = tmp_path / "out"
    argv = _argv(checkpoints["gpt2"], text_file, out, "--eval", str(text_file), "--eval-seq-len", "8",
                 "--no-eval-original")
    assert main(argv) == 0
    assert list(pd.read_csv(out / "evaluation.csv")["model"]) == ["compressed"]


def test_without_eval_no_evaluation_is_written(checkpoints, text_file, tmp_path):
    assert main(_argv(checkpoints["gpt2"], text_file, tmp_path / "out")) == 0
    assert not (tmp_path / "out" / "evaluation.csv").exists()


@pytest.mark.parametrize("case, words", [
    ("missing file", "--eval"),
    ("empty file", "holds no text"),
    ("window beyond positions", "beyond the model's 32 positions"),
    ("not a causal lm", "is not a causal language model"),
    ("seq len without eval", "go with --eval"),
])  # fmt: skip
def test_bad_eval_input_ends_in_one_message_and_writes_nothing(case, words, checkpoints, text_file, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    model, extra = checkpoints["llama"], ["--eval", str(text_file)]
    if case == "missing file":
        extra = ["--eval", str(tmp_path / "absent.txt")]
    elif case == "empty file":
        extra = ["--eval", str(empty)]
    elif case == "window beyond positions":
        extra += ["--eval-seq-len", "64"]
    elif case == "not a causal lm":
        model = checkpoints["bert"]
    elif case == "seq len without eval":
        extra = ["--eval-seq-len", "8"]
    before = sorted(path.name for path in tmp_path.iterdir())
    assert main(_argv(model, text_file, tmp_path / "out", *extra)) == 1
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_an_eval_file_inside_out_dir_is_never_overwritten(checkpoints, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    kept = out / "eval.txt"
    kept.write_text(text_file.read_text())
    aliased = tmp_path / "alias"
    aliased.symlink_to(out)
    argv = _argv(checkpoints["llama"], text_file, out, "--overwrite", "--eval", str(aliased / "eval.txt"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--eval file" in err and len(err.strip().splitlines()) == 1, err
    assert kept.read_text() == text_file.read_text()
