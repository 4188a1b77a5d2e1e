"""Generation speed of a compressed model against its dense original, in the same run.

``--model tinyllama`` (the default): a TinyLlama-shaped LLaMA (hidden 2048, FFN 5632, 32 heads / 4
kv heads, vocab 32000; ``--layers`` blocks, 8 by default to fit a shared machine) in ``--dtype``
(bfloat16 by default); the compressed copy has every linear layer of the blocks sketched at
``param_ratio`` (0.5 by default; the size ``convert`` picks, ``num_terms=1``) with **random
factors**: speed does not depend on the values, so nothing is fitted. ``--model smollm2``:
SmolLM2-135M-Instruct (30 blocks, lm_head tied to the embedding; ``--model-dir`` another causal LM
checkpoint) in ``--dtype`` (float32, its checkpoint's, by default), compressed by
``panther_lite.convert`` over its block linear layers at ``param_ratio`` (0.6 by default, uniform
allocation, no calibration: the speed depends on the layer sizes only, not on how well they fit);
written as ``generate_smollm2.csv`` / ``.png`` (``generate_smollm2_bfloat16.*`` in the other dtype).
The compressed model runs twice: with its factors row-major (``compressed``, the default) and in the
decode layout (``decode layout``, :func:`panther_lite.nn.use_decode_layout`). Measured, the three
models alternating, after one warm-up of each:

- ``decode``: seconds per generated token at batch 1, greedy ``model.generate`` of ``--new-tokens``
  tokens after a 32-token prompt, minus the same with 1 new token (so the prefill drops out);
- ``prefill``: one forward of a ``--prompt``-token prompt (batch 1, the cache built as ``generate``
  builds it).

Medians of ``--repeats`` runs with their min and max. ``--clock cpu`` times with the process's CPU
time instead of the wall clock: on a machine shared with other jobs a single-threaded run
(``--threads 1``) then leaves out the time it waits for a core (it still shares caches and memory
bandwidth); with more threads it would add their times up, so it needs ``--threads 1``. Targets: decode speed-up >= 0.8 x the
parameter-bytes ratio (dense bytes / compressed bytes, U buffers included), prefill speed-up >=
0.8 x the FLOP ratio (matmul FLOPs per token: linear layers and lm_head; attention scores left out).

    python benchmarks/bench_generate.py --threads 1 --output-dir benchmarks/results/cpu
    python benchmarks/bench_generate.py --model smollm2 --threads 1 --output-dir benchmarks/results/cpu
    python benchmarks/bench_generate.py --model smollm2 --dtype bfloat16 --threads 1 --clock cpu --repeats 9
    python benchmarks/bench_generate.py --layers 1 --prompt 32 --new-tokens 4 --repeats 1   # seconds
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from panther_lite.benchmark import device_name, new_figure, ratio_layout, save_figure
from panther_lite import apply_conversion_config
from panther_lite.nn import SKLinear, use_decode_layout

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"tinyllama": (0.5, "bfloat16"), "smollm2": (0.6, "float32")}  # param_ratio, dtype
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)


def tinyllama(args):
    """The dense TinyLlama-shaped model and its copy sketched with random factors."""
    import transformers

    config = transformers.LlamaConfig(**SHAPE, num_hidden_layers=args.layers, tie_word_embeddings=False)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    compressed = copy.deepcopy(dense)
    apply_conversion_config(compressed, ratio_layout(compressed.model.layers, args.param_ratio, prefix="model.layers"))
    return dense, compressed


def smollm2(args):
    """The dense SmolLM2-135M (or ``--model-dir``) and its copy converted over the block linear
    layers (uniform allocation, SVD of each weight, no calibration); lm_head stays tied and dense."""
    from transformers import AutoModelForCausalLM

    import panther_lite

    model_dir = args.model_dir
    if model_dir is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_llm_ppl import smollm2_dir

        model_dir = smollm2_dir(ROOT / "benchmarks" / "out")
    dense = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype)).eval()
    compressed = copy.deepcopy(dense)
    panther_lite.convert(compressed, param_ratio=args.param_ratio, allocation="uniform",
                         target_modules=r"model\.layers\.\d+\..*", progress=False)
    return dense, compressed


def models(args) -> dict:
    """{variant: model in eval mode}: dense, compressed, compressed in the decode layout."""
    dense, compressed = (smollm2 if args.model == "smollm2" else tinyllama)(args)
    return {"dense": dense, "compressed": compressed.eval(),
            "decode layout": use_decode_layout(copy.deepcopy(compressed)).eval()}


def stored_bytes(model) -> int:
    """Bytes of the parameters and buffers, a tensor shared by two modules (a tied lm_head) once."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def matmul_flops_per_token(model) -> int:
    """2 x the multiply-adds of the linear layers (an SKLinear: its stored factors) and lm_head
    (tied or not: its product runs once per token; the embedding lookup is no matmul)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, SKLinear):
            total += module.S1.numel() + module.U1.numel() + module.U2.numel() + module.S2.numel()
    return 2 * total


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _seconds(fn, clock: str) -> float:
    started = CLOCKS[clock]()
    fn()
    return CLOCKS[clock]() - started


def _generate(model, prompt: torch.Tensor, new_tokens: int) -> None:
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0)


def measure(model, args) -> dict:
    """One run of each measure: decode seconds per token and prefill seconds."""
    vocab = model.config.vocab_size
    short = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    long = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = _seconds(lambda: _generate(model, short, args.new_tokens), args.clock)
        first = _seconds(lambda: _generate(model, short, 1), args.clock)
        prefill = _seconds(lambda: model(input_ids=long, use_cache=True), args.clock)
    return dict(decode=(full - first) / (args.new_tokens - 1), prefill=prefill)


def _summary(runs: list, name: str, measure_name: str) -> dict:
    values = [run[measure_name] for run in runs]
    return dict(model=name, measure=measure_name, median_s=statistics.median(values), min_s=min(values),
                max_s=max(values), runs=len(values))


def _plot(df: pd.DataFrame, ratios: dict, path: Path, title: str) -> None:
    fig = new_figure(figsize=(9, 4))
    axes = fig.subplots(1, 2)
    for ax, measure_name in zip(axes, ("decode", "prefill")):
        rows = df[df["measure"] == measure_name]
        errors = [rows["median_s"] - rows["min_s"], rows["max_s"] - rows["median_s"]]
        ax.bar(rows["model"], rows["median_s"], yerr=errors, capsize=4, color=["tab:gray", "tab:blue", "tab:green"])
        speedups = " / ".join(f"{value:.2f}x" for value in rows["speedup"].iloc[1:])
        unit = "s / token" if measure_name == "decode" else "s / prompt"
        ax.set(ylabel=unit, title=f"{measure_name}: {speedups} (target {0.8 * ratios[measure_name]:.2f}x)")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``param_ratio`` and ``dtype`` default by model."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(DEFAULTS), default="tinyllama")
    parser.add_argument("--model-dir", type=Path, help="--model smollm2: a causal LM checkpoint (default: SmolLM2)")
    parser.add_argument("--layers", type=int, default=8, help="--model tinyllama: blocks")
    parser.add_argument("--param-ratio", type=float, help="default: 0.5 (tinyllama), 0.6 (smollm2)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 (tinyllama), float32")
    parser.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: the process's CPU time (needs --threads 1)")
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (CPU time adds up the threads' times)")
    default_ratio, default_dtype = DEFAULTS[args.model]
    args.param_ratio, args.dtype = args.param_ratio or default_ratio, args.dtype or default_dtype
    return args


def timed_runs(variants: dict, args) -> dict:
    """{variant: [measure()'s dict per repeat]}, the variants alternating, after a warm-up round."""
    runs = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, model in variants.items():
            result = measure(model, args)
            if repeat:
                runs[name].append(result)
        print(f"round {repeat}: " + ", ".join(f"{n} {r[-1] if r else 'warm-up'}" for n, r in runs.items()), flush=True)
    return runs


def table(variants: dict, runs: dict, ratios: dict, args) -> pd.DataFrame:
    """Median / min / max per variant and measure, with the speed-up against dense and its target."""
    df = pd.DataFrame([_summary(runs[name], name, m) for m in ("decode", "prefill") for name in variants])
    for measure_name, ratio in ratios.items():
        rows = df["measure"] == measure_name
        dense_s = df[rows & (df["model"] == "dense")]["median_s"].iloc[0]
        df.loc[rows, "speedup"] = dense_s / df.loc[rows, "median_s"]
        df.loc[rows, "ratio"], df.loc[rows, "target"] = ratio, 0.8 * ratio
    df["layers"] = variants["dense"].config.num_hidden_layers
    df["dtype"], df["prompt"], df["new_tokens"] = args.dtype, args.prompt, args.new_tokens
    df["param_ratio"], df["clock"] = args.param_ratio, args.clock
    df["machine"] = f"{device_name('cpu')}, {os.cpu_count()} cores"
    return df


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    variants = models(args)
    runs = timed_runs(variants, args)
    dense, compressed = variants["dense"], variants["compressed"]
    ratios = dict(decode=stored_bytes(dense) / stored_bytes(compressed),
                  prefill=matmul_flops_per_token(dense) / matmul_flops_per_token(compressed))
    df = table(variants, runs, ratios, args)
    df["load"] = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"  # 1-minute load average, start -> end
    stem = "generate" if args.model == "tinyllama" else f"generate_{args.model}"
    stem += "" if args.dtype == DEFAULTS[args.model][1] else f"_{args.dtype}"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.output_dir / f"{stem}.csv", index=False)
    print(df.to_string(), flush=True)
    shape = (f"TinyLlama shape, {args.layers} layers" if args.model == "tinyllama"
             else f"SmolLM2-135M ({df['layers'][0]} layers, tied lm_head)")
    title = (f"{shape}, {args.dtype}, param_ratio {args.param_ratio}: {df['machine'][0]}, load {df['load'][0]}, "
             f"{args.clock} clock")
    _plot(df, ratios, args.output_dir / f"{stem}.png", title)


if __name__ == "__main__":
    main()
