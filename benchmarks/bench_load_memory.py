"""Peak resident memory of loading a panther_lite output, against its size on disk.

A LLaMA-shaped bf16 output at ``param_ratio=0.5`` (every linear layer of the blocks sketched
with the size ``convert`` picks for that ratio, ``num_terms=1``; embeddings, norms and lm_head
dense) is written block by block the way ``compress`` streams it, with **random factors**: no
fitting, since loading memory does not depend on the values. The same model is also saved
whole by ``panther_lite.save_pretrained`` (the in-memory output, one file). Each load runs in a
fresh process: imports, ``from_pretrained`` and one forward of 16 tokens; the peak (after
``from_pretrained``, and after the forward) is the
kernel's high-water mark of the process (``VmHWM``, Linux: unlike ``ru_maxrss`` it does not
carry the parent's peak across ``exec``), imports alone measured apart.
The dense original (``--dense``: a random checkpoint of the same shape) loaded by transformers
is the reference. Target: peak <= size on disk + 0.6 GB.

Loaders: ``panther_lite`` (``panther_lite.from_pretrained(AutoModelForCausalLM, out)``),
``auto`` (``import panther_lite; AutoModelForCausalLM.from_pretrained(out)``, transformers'
memory-mapped reading), ``auto, disable_mmap`` (the same with ``disable_mmap=True``).

    python benchmarks/bench_load_memory.py --shape tinyllama --output-dir benchmarks/results/cpu
    python benchmarks/bench_load_memory.py --shape tinyllama --layers 2 --work-dir /tmp/load  # quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

import panther_lite
from panther_lite.benchmark import device_name, new_figure, ratio_layout, save_figure
from panther_lite.benchmark.checkpoints import write_random_checkpoint
from panther_lite.conversion.saving.pretrained import save_transformers_config
from panther_lite import apply_conversion_config
from panther_lite.conversion.saving.shards import SHARD_INDEX_NAME, shard_name

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tinyllama": (2048, 5632, 22, 32, 4, 32000),
    "llama7b": (4096, 11008, 32, 32, 32, 32000),
}
LOADERS = ("panther_lite", "auto", "auto, disable_mmap")
OUTPUTS = ("streamed", "in memory")
GB = 1e9


def llama_config(shape: str, layers: int):
    import transformers

    hidden, inter, depth, heads, kv_heads, vocab = SHAPES[shape]
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or depth, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, dtype="bfloat16", tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"])  # fmt: skip


def write_streamed_output(directory: Path, config, param_ratio: float, seed: int = 0) -> int:
    """A panther_lite output of ``config`` with random factors, one shard per block (what
    ``compress`` writes), built on the meta device part by part. Returns the bytes of the weights."""
    import transformers
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    conversion = ratio_layout(model.model.layers, param_ratio, prefix="model.layers")
    apply_conversion_config(model, conversion)
    state = model.state_dict()
    blocks = [[key for key in state if key.startswith(f"model.layers.{i}.")] for i in range(config.num_hidden_layers)]
    parts = [[key for key in state if not key.startswith("model.layers.")], *blocks]
    generator, weight_map, total = torch.Generator().manual_seed(seed), {}, 0
    for index, keys in enumerate(parts):
        tensors = {key: (torch.randn(state[key].shape, generator=generator) * 0.02).to(torch.bfloat16) for key in keys}
        save_file(tensors, str(directory / shard_name(index, len(parts))), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard_name(index, len(parts))))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SHARD_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    save_transformers_config(model, directory, conversion)
    return total


def _weights_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def _high_water_mark() -> int:
    """This process's peak resident memory so far (``VmHWM``, bytes)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def load_and_run(directory: Path, loader: str) -> None:
    """In this (fresh) process: import, load with ``loader``, one forward of 16 tokens; prints
    the peak resident memory after the imports and at the end (bytes)."""
    import transformers

    imports = _high_water_mark()
    auto = transformers.AutoModelForCausalLM
    if loader == "panther_lite":
        model = panther_lite.from_pretrained(auto, directory)
    elif loader == "dense":
        model = auto.from_pretrained(directory)
    else:
        model = auto.from_pretrained(directory, disable_mmap=loader.endswith("disable_mmap"))
    sketched = sum(isinstance(m, panther_lite.SKLinear) for m in model.modules())
    loaded = _high_water_mark()
    with torch.no_grad():
        model(input_ids=torch.arange(16)[None])
    peak = _high_water_mark()
    print(json.dumps(dict(imports_bytes=imports, load_bytes=loaded, peak_bytes=peak, sketched_layers=sketched)))


def _environment() -> dict:
    """This checkout's panther_lite first on the path of the child processes, offline."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def _measure(directory: Path, loader: str) -> dict:
    command = [sys.executable, __file__, "--load", str(directory), "--loader", loader]
    done = subprocess.run(command, capture_output=True, text=True, env=_environment())
    if done.returncode:
        raise RuntimeError(f"loading {directory} with {loader} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plot(df: pd.DataFrame, path: Path) -> None:
    fig = new_figure(figsize=(9, 4.5))
    ax = fig.subplots()
    labels = [f"{row.output}\n{row.loader}" for row in df.itertuples()]
    ax.bar(labels, df["peak_gb"], color="tab:blue", label="peak: imports, from_pretrained and one forward")
    ax.bar(labels, df["load_peak_gb"], color="tab:cyan", label="peak: imports and from_pretrained")
    ax.bar(labels, df["imports_gb"], color="tab:gray", label="imports alone")
    ax.scatter(labels, df["size_gb"] + 0.6, marker="_", s=900, color="tab:red", label="target: size + 0.6 GB",
               zorder=3)
    ax.scatter(labels, df["size_gb"], marker="_", s=900, color="black", label="size on disk", zorder=3)
    ax.set(ylabel="GB", title=f"Loading {df['shape'][0]} ({df['layers'][0]} layers, bf16): {df['machine'][0]}")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="tinyllama")
    parser.add_argument("--layers", type=int, default=0, help="blocks (default: the shape's own depth)")
    parser.add_argument("--param-ratio", type=float, default=0.5)
    parser.add_argument("--dense", action="store_true", help="also load the dense original (written to --work-dir)")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    parser.add_argument("--outputs", nargs="+", choices=OUTPUTS, default=list(OUTPUTS),
                        help="the in-memory output is the streamed one loaded and saved whole")
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--work-dir", type=Path, default=Path("benchmarks/out/load_memory"))
    parser.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # internal: one load in this process
    parser.add_argument("--loader", choices=[*LOADERS, "dense"], default="panther_lite", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        load_and_run(args.load, args.loader)
        return
    config = llama_config(args.shape, args.layers)
    work = args.work_dir / f"{args.shape}_{config.num_hidden_layers}"
    shutil.rmtree(work, ignore_errors=True)
    streamed, in_memory = work / "streamed", work / "in_memory"
    write_streamed_output(streamed, config, args.param_ratio)
    if "in memory" in args.outputs:
        resave = (f"import panther_lite, transformers; panther_lite.save_pretrained(panther_lite.from_pretrained("
                  f"transformers.AutoModelForCausalLM, {str(streamed)!r}), {str(in_memory)!r})")
        subprocess.run([sys.executable, "-c", resave], check=True, capture_output=True, env=_environment())
    outputs = [(name, directory) for name, directory in zip(OUTPUTS, (streamed, in_memory)) if name in args.outputs]
    cases = [(name, directory, loader) for name, directory in outputs for loader in args.loaders]
    if args.dense:
        write_random_checkpoint(work / "dense", config, "a b c")
        cases.insert(0, ("dense original", work / "dense", "dense"))
    rows = []
    for name, directory, loader in cases:
        measured = _measure(directory, loader)
        rows.append(dict(shape=args.shape, layers=config.num_hidden_layers, param_ratio=args.param_ratio, output=name,
                         loader=loader, size_gb=_weights_bytes(directory) / GB,
                         imports_gb=measured["imports_bytes"] / GB, load_peak_gb=measured["load_bytes"] / GB,
                         peak_gb=measured["peak_bytes"] / GB,
                         sketched_layers=measured["sketched_layers"]))
        rows[-1]["load_within_target"] = rows[-1]["load_peak_gb"] <= rows[-1]["size_gb"] + 0.6
        rows[-1]["within_target"] = rows[-1]["peak_gb"] <= rows[-1]["size_gb"] + 0.6
        print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    df["machine"] = device_name("cpu")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"load_memory_{args.shape}"
    df.to_csv(args.output_dir / f"{stem}.csv", index=False)
    _plot(df, args.output_dir / f"{stem}.png")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
