"""Whether the fits of a block's layers should be split across ranks: the time of each fit of one
TinyLlama-shaped block (hidden 2048, FFN 5632, 32 heads / 4 kv heads; ``param_ratio=0.5`` uniform,
calibrated on ``--batches`` batches of 2 × 256 random tokens) against the time to send the fitted
factors between 2 local processes over gloo.

Rank 0 converts a one-block model alone (rank 1 waits before the group starts, so the fits have the
CPU threads they would have) and times each layer's fit; then the two ranks exchange factors of
that block's size: a broadcast of all of them from rank 0 (one rank fits, the other receives), and
an all-gather of half from each (the fits split in two and gathered). Medians of ``--repeats``.
Splitting pays when ``fits × (1 − 1/world)`` exceeds the gather. One CSV (a row per layer, then
the exchanges) in ``--output-dir``, with the machine and its load average. ``--split``: instead,
both ranks convert the block together, each fitting its share (``fit_split_ranks.csv``: each
rank's fits and its wall time of the conversion).

    python benchmarks/bench_fit_split.py --output-dir benchmarks/results/cpu [--split]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _fits(batches: int, dtype) -> list:
    """``[(layer, shape, seconds, factor bytes)]`` of converting one TinyLlama block."""
    import torch
    import transformers

    import panther_lite
    from panther_lite.conversion.fitting import planned

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    data = [dict(input_ids=torch.randint(0, 256, (2, 256), generator=generator)) for _ in range(batches)]
    found, fit = [], planned.fit_layer

    def timed(record, *args, **kwargs):
        started = time.perf_counter()
        result = fit(record, *args, **kwargs)
        seconds = time.perf_counter() - started
        tensors = list(result.module.parameters()) + list(result.module.buffers())
        found.append((record.name, str(tuple(record.module.weight.shape)), seconds,
                      sum(t.numel() * t.element_size() for t in tensors)))
        return result

    planned.fit_layer = timed
    try:
        panther_lite.convert(model, calibration_data=data, param_ratio=0.5, progress=False)
    finally:
        planned.fit_layer = fit
    table = {}
    for name, shape, seconds, size in found:  # a layer fitted more than once (a shrinkage check): its time summed
        table[name] = (name, shape, table.get(name, (0, 0, 0.0))[2] + seconds, size)
    return list(table.values())


def _exchange(total_bytes: int, repeats: int) -> dict:
    """Median seconds of a broadcast of ``total_bytes`` from rank 0 and of an all-gather of half from each rank."""
    import torch
    import torch.distributed as dist

    whole = torch.ones(total_bytes // 4, dtype=torch.float32)
    half = torch.ones(total_bytes // 8, dtype=torch.float32)
    parts = [torch.empty_like(half) for _ in range(dist.get_world_size())]
    timings = {"broadcast (one rank fits)": [], "all-gather of halves (split fits)": []}
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(whole, src=0)
        timings["broadcast (one rank fits)"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        dist.all_gather(parts, half)
        timings["all-gather of halves (split fits)"].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in timings.items()}


def split_main(args: argparse.Namespace) -> None:
    """Both ranks convert the block together (the fits split between them): each rank's fits, to
    ``fit_split_ranks.csv`` (a row per fit with its rank; a layer appears once)."""
    import pandas as pd
    import torch
    import torch.distributed as dist

    from panther_lite.benchmark import device_name

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    started = time.perf_counter()
    rows = _fits(args.batches, getattr(torch, args.dtype))
    wall = time.perf_counter() - started
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (rows, wall))
    if dist.get_rank() == 0:
        table = pd.DataFrame([(rank, *row, seconds) for rank, (rows, seconds) in enumerate(found) for row in rows],
                             columns=["rank", "step", "shape", "seconds", "bytes", "convert_wall_s"])
        table["machine"], table["load_1min"], table["dtype"] = device_name("cpu"), os.getloadavg()[0], args.dtype
        table.to_csv(args.output_dir / "fit_split_ranks.csv", index=False)
        print(table.to_string(index=False))
        print(table.groupby("rank")["seconds"].sum().to_string())
    dist.destroy_process_group()


def rank_main(args: argparse.Namespace) -> None:
    import pandas as pd
    import torch
    import torch.distributed as dist

    from panther_lite.benchmark import device_name

    torch.set_num_threads(args.threads)
    rank = int(os.environ["RANK"])
    rows = _fits(args.batches, getattr(torch, args.dtype)) if rank == 0 else []
    dist.init_process_group("gloo")
    total = dist.get_rank() == 0 and sum(row[3] for row in rows)
    total = [total]
    dist.broadcast_object_list(total, src=0)
    exchanged = _exchange(int(total[0]), args.repeats)
    if rank == 0:
        table = pd.DataFrame(rows, columns=["step", "shape", "seconds", "bytes"])
        table = pd.concat([table, pd.DataFrame([(name, "", seconds, int(total[0]) if "broadcast" in name else
                                                 int(total[0]) // 2) for name, seconds in exchanged.items()],
                                               columns=table.columns)])
        table["machine"], table["load_1min"], table["dtype"] = device_name("cpu"), os.getloadavg()[0], args.dtype
        table.to_csv(args.output_dir / "fit_split.csv", index=False)
        print(table.to_string(index=False))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results/cpu"))
    parser.add_argument("--batches", type=int, default=2, help="calibration batches of 2 × 256 tokens (default 2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--split", action="store_true",
                        help="instead: both ranks convert the block together, the fits split (fit_split_ranks.csv)")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        (split_main if args.split else rank_main)(args)
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(Path(__file__).resolve()), "--rank-worker", "--output-dir", str(args.output_dir), "--batches",
            str(args.batches), "--dtype", args.dtype, "--threads", str(args.threads), "--repeats", str(args.repeats)] + ["--split"] * args.split
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run([*launcher, *argv], check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})


if __name__ == "__main__":
    main()
