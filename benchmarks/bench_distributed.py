"""Time and peak memory per rank of ``panther_lite.convert`` across 1, 2 and 4 processes
(``torchrun``, gloo on the CPU) on the TinyLlama-1.1B shape (2048 × 22 layers, FFN 5632, 32 heads /
4 kv heads, vocab 32000; random init; ``--hidden`` scales it: FFN 2.75×, a head per 64), ``param_ratio=0.5``
uniform, calibrated on ``--batches`` batches of 2 × 256 random tokens (batch ``i`` on rank ``i % N``);
with ``--streamed``, the streamed ``compress_checkpoint`` of the model saved once (each rank reads
the blocks itself; rank 0 writes).

Each world size runs in fresh processes (``python -m torch.distributed.run --standalone``); each
rank reports the wall time of its ``convert`` and its peak resident memory (the kernel's
high-water mark, so the model's own copy included: every rank holds the whole model), with the
machine and its 1-minute load average at the end, and ``--note`` (the run's conditions). One CSV
(a row per world size and rank) and one PNG (time and peak memory against the processes) in
``--output-dir``. The processes share the calibration (each runs its batches) and the fits (each
layer fitted by one rank, ``conversion/fitting/across.py``); the exchange costs
``N × Σ fan_in² × 8`` bytes per block received per rank (``docs/large_models.rst``).

    python benchmarks/bench_distributed.py --output-dir benchmarks/results/cpu
    python benchmarks/bench_distributed.py --quick        # a tiny model, seconds
    python benchmarks/bench_distributed.py --layers 4     # fewer TinyLlama blocks
    python benchmarks/bench_distributed.py --streamed --layers 4 --hidden 512 --worlds 1 2
    python benchmarks/bench_distributed.py --streamed --layers 4 --name distributed_tinyllama4 --note "..."
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLDS = (1, 2, 4)
_VOCAB = {True: 256, False: 32000}  # --quick's vocabulary, TinyLlama's


def _model(quick: bool, layers: int, hidden: int = 2048):
    import torch
    import transformers

    torch.manual_seed(0)
    if quick:
        config = transformers.LlamaConfig(vocab_size=_VOCAB[True], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        heads = hidden // 64
        config = transformers.LlamaConfig(vocab_size=_VOCAB[False], hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(heads // 8, 1))
    return transformers.LlamaForCausalLM(config).eval(), config.vocab_size


def rank_main(args: argparse.Namespace) -> None:
    """One rank: convert, then append ``{world, rank, seconds, peak_gb}`` to ``--record``."""
    import torch
    import torch.distributed as dist

    import panther_lite
    from panther_lite.benchmark import device_name

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model, vocab = _model(args.quick, args.layers, args.hidden) if args.source is None else (None, _VOCAB[args.quick])
    length = 16 if args.quick else 256
    generator = torch.Generator().manual_seed(1)
    batches = [dict(input_ids=torch.randint(0, vocab, (2, length), generator=generator)) for _ in range(args.batches)]
    started = time.perf_counter()
    if args.source is None:
        panther_lite.convert(model, calibration_data=batches, param_ratio=0.5, progress=False)
    else:
        panther_lite.compress_checkpoint(args.source, args.source.parent / f"out-{world}", calibration_data=batches,
                                         param_ratio=0.5, progress=False, overwrite=True)
    seconds = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    rank = dist.get_rank() if world > 1 else 0
    with open(args.record, "a", encoding="utf-8") as record:
        record.write(json.dumps(dict(world=world, rank=rank, seconds=seconds, peak_gb=peak_gb, machine=device_name("cpu"),
                                     load_1min=os.getloadavg()[0], note=args.note)) + "\n")
    if world > 1:
        dist.destroy_process_group()


def _run_world(world: int, args: argparse.Namespace, record: Path) -> None:
    argv = [str(Path(__file__).resolve()), "--rank-worker", "--record", str(record), "--batches", str(args.batches),
            "--layers", str(args.layers), "--hidden", str(args.hidden), "--threads", str(args.threads), "--note", args.note,
            *(["--quick"] if args.quick else []), *(["--source", str(args.source)] if args.source else [])]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run([*launcher, *argv], check=True, env=env)


def _plot(table, path: Path, streamed: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    summary = table.groupby("world").agg(seconds=("seconds", "max"), peak_gb=("peak_gb", "max"), load=("load_1min", "max"))
    time_axis.plot(summary.index, summary["seconds"], marker="o")
    for world, row in summary.iterrows():  # the machine's load beside each point: the runs share it
        time_axis.annotate(f"load {row['load']:.1f}", (world, row["seconds"]), textcoords="offset points", xytext=(4, -12))
    time_axis.set(xlabel="processes", ylabel="convert wall time, slowest rank (s)", xticks=list(summary.index), ylim=(0, None))
    memory_axis.plot(summary.index, summary["peak_gb"], marker="o")
    memory_axis.set(xlabel="processes", ylabel="peak resident memory per rank (GB)", xticks=list(summary.index),
                    ylim=(0, None))
    figure.suptitle(f"panther_lite.{'compress_checkpoint (streamed)' if streamed else 'convert'} across processes "
                    "(gloo, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/cpu"))
    parser.add_argument("--quick", action="store_true", help="a tiny model instead of the TinyLlama shape")
    parser.add_argument("--layers", type=int, default=22, help="TinyLlama blocks (default 22)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, TinyLlama's)")
    parser.add_argument("--streamed", action="store_true", help="the streamed compress_checkpoint, not convert")
    parser.add_argument("--name", default="distributed", help="the CSV's and PNG's name (default distributed)")
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=8, help="calibration batches of 2 sequences (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--note", default="", help="the run's conditions (cores, other work), a CSV column")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args)
        return
    import pandas as pd

    args.output_dir.mkdir(parents=True, exist_ok=True)
    record = args.output_dir / "distributed_ranks.jsonl"
    record.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.streamed:
            args.source = Path(scratch) / "source"
            _model(args.quick, args.layers, args.hidden)[0].save_pretrained(args.source)
        for world in args.worlds:
            _run_world(world, args, record)
    table = pd.read_json(record, lines=True).sort_values(["world", "rank"])
    record.unlink()
    table.to_csv(args.output_dir / f"{args.name}.csv", index=False)
    _plot(table, args.output_dir / f"{args.name}.png", args.streamed)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
