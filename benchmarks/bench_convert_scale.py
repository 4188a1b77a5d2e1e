"""Time and memory of panther_lite.convert against depth and width of LLaMA-shaped models.

Random-init ``transformers.LlamaForCausalLM`` models, calibrated on 4 batches of 2 × 256
tokens, ``param_ratio=0.5`` over every linear layer (lm_head included), each case in a fresh
process; memory added is the peak resident memory during ``convert`` minus the resident
memory just before it (sampled every millisecond); ``new_layers_gb`` is the part of it that
the new sketched layers themselves take (the dense originals stay until the swap is final). One CSV per part (and one PNG) in
``--output-dir``:

``depth``      width 512 (FFN 1376, 8 heads), 2/4/8/16 layers: global + sequential and uniform
``width``      width 2048 (FFN 5632, 32 heads / 4 kv heads), bf16, 2/8 layers: uniform and global + sequential
``tinyllama``  the TinyLlama-1.1B shape (2048 × 22 layers, vocab 32000), bf16: global + sequential
``streamed``   the ``compress`` command on TinyLlama-shaped random-init bf16 checkpoints of 6/12/22
               layers written to disk shard by shard: out of core (its default) and ``--in-memory``
               (the whole model loaded), uniform ``--param-ratio 0.5``, the other options at their
               defaults, calibrated on ``benchmarks/data/natural_sentences.txt`` (128 lines,
               about 1,500 tokens); peak resident memory of the whole command process (the
               kernel's high-water mark) against the checkpoint's size, and wall time
``llama7b``    the same, once, streamed, for a LLaMA-2-7B-shaped checkpoint (4096 × 32 layers, FFN
               11008, 13.5 GB): writes a trace of its peak every 10 s beside the checkpoint

Each case runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (what the docs recommend for large
models on glibc: freed fit buffers go back to the OS instead of staying in malloc's heap; the
width-2048 2-layer uniform case adds 1.38 GB with it, 1.62 GB without); ``--default-malloc``
measures without it. ``--note`` describes the machine's load in the CSV.

    python benchmarks/bench_convert_scale.py --part depth
    python benchmarks/bench_convert_scale.py --part tinyllama --output-dir benchmarks/results/cpu
    python benchmarks/bench_convert_scale.py --part depth --quick   # tiny sizes, seconds
    python benchmarks/bench_convert_scale.py --part tinyllama --calibration-device cuda  # + peak GPU memory
    python benchmarks/bench_convert_scale.py --part streamed --work-dir /tmp/scale  # checkpoints written there
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import panther_lite
from panther_lite.benchmark import device_name, new_figure, save_figure
from panther_lite.benchmark.checkpoints import write_random_checkpoint
from panther_lite.benchmark.memory import ResidentPeak, command_peak

PARTS = ("depth", "width", "tinyllama", "streamed", "llama7b")
COMMAND_PARTS = ("streamed", "llama7b")
STREAMED_DEPTHS = (6, 12, 22)
COMMAND_MODES = ("streamed", "in memory")
TEXT = Path(__file__).resolve().parent / "data" / "natural_sentences.txt"
COMMAND_OPTIONS = ["--param-ratio", "0.5", "--quiet"]  # the rest at their defaults
RECOMMENDED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MODES = {"uniform": dict(), "global+sequential": dict(allocation="global", sequential=True)}


def cases(part: str, quick: bool) -> list:
    """``(layers, hidden, ffn, heads, kv_heads, vocab, dtype, mode)`` of each case of ``part``."""
    if quick:
        return [(layers, 64, 128, 4, 2, 256, "float32", mode) for layers in (2, 4) for mode in MODES]
    if part == "depth":
        return [(layers, 512, 1376, 8, 8, 32000, "float32", mode) for layers in (2, 4, 8, 16) for mode in MODES]
    if part == "width":
        return [(layers, 2048, 5632, 32, 4, 32000, "bfloat16", mode) for layers in (2, 8) for mode in MODES]
    return [(22, 2048, 5632, 32, 4, 32000, "bfloat16", "global+sequential")]


def _new_layers_bytes(report, dtype: str) -> int:
    """Bytes of the sketched layers convert built (U buffers included): memory added that
    stays, since the dense originals are kept until the swap is final (for its undo)."""
    converted = report["status"] == "converted"
    return int(report.loc[converted, "stored_params"].sum()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def run_case(case: list, tokens: int, calibration_device: str = "cpu") -> dict:
    """Build the model, convert it with calibration (statistics and the block at work on
    ``calibration_device``; the model stays on the CPU), measure (in this process)."""
    import transformers

    layers, hidden, ffn, heads, kv_heads, vocab, dtype, mode = case
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max(tokens, 256),
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    parameters = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, vocab, (2, tokens), generator=generator)} for _ in range(4)]
    before = ResidentPeak.now()
    start = time.perf_counter()
    on_gpu = calibration_device.startswith("cuda")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    with ResidentPeak() as memory:
        report = panther_lite.convert(
            model, param_ratio=0.5, calibration_data=batches, progress=False,
            calibration_device=calibration_device, **MODES[mode],
        )
    seconds = time.perf_counter() - start
    return dict(
        layers=layers, hidden=hidden, ffn=ffn, dtype=dtype, mode=mode, parameters=parameters,
        model_gb=model_bytes / 1e9, seconds=seconds, added_gb=(memory.peak - before) / 1e9,
        converted=int((report["status"] == "converted").sum()), pipeline=report.attrs["pipeline"],
        new_layers_gb=_new_layers_bytes(report, dtype) / 1e9, calibration_device=calibration_device,
        peak_gpu_gb=torch.cuda.max_memory_allocated() / 1e9 if on_gpu else float("nan"),
        mean_output_error=float(report["output_error"].mean()),
    )


def command_cases(part: str, quick: bool, depths=STREAMED_DEPTHS, modes=COMMAND_MODES) -> list:
    """``(layers, hidden, ffn, heads, kv_heads, modes)`` of each checkpoint the command compresses
    (``depths`` and ``modes``: the streamed part's)."""
    if quick:
        return [(2, 64, 128, 4, 2, COMMAND_MODES)]
    if part == "streamed":
        return [(layers, 2048, 5632, 32, 4, tuple(modes)) for layers in depths]
    return [(32, 4096, 11008, 32, 32, ("streamed",))]


def run_command_case(case: tuple, work: Path, environment: dict, trace: Path, device: str = "cpu") -> list:
    """Write the case's checkpoint, compress it in each mode (a fresh process each), remove it."""
    import transformers

    layers, hidden, ffn, heads, kv_heads, modes = case
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048, dtype="bfloat16",
    )
    checkpoint, output = work / f"llama-{layers}x{hidden}", work / "out"
    weights = write_random_checkpoint(checkpoint, config, TEXT.read_text())
    rows = []
    for mode in modes:
        shutil.rmtree(output, ignore_errors=True)
        argv = [sys.executable, "-m", "panther_lite", "compress", str(checkpoint), "--calibration", str(TEXT),
                "--output", str(output), *COMMAND_OPTIONS, "--calibration-device", device,
                *(["--in-memory"] if mode == "in memory" else [])]
        with open(trace, "a") as log:
            log.write(f"# {layers} layers, {mode}: seconds,peak_bytes\n")
            measured = command_peak(argv, environment, log)
        rows.append(dict(layers=layers, hidden=hidden, ffn=ffn, dtype="bfloat16", mode=mode,
                         checkpoint_gb=weights / 1e9, seconds=measured["seconds"], peak_gb=measured["peak_bytes"] / 1e9,
                         peak_over_checkpoint=measured["peak_bytes"] / weights, returncode=measured["returncode"],
                         options=" ".join(COMMAND_OPTIONS), calibration_device=device))
        print(rows[-1], flush=True)
    shutil.rmtree(checkpoint)
    shutil.rmtree(output, ignore_errors=True)
    return rows


def _finish(fig, df: pd.DataFrame, what: str, path: Path) -> None:
    """Legends, the title naming ``what`` ran, the machine and its load, and the PNG."""
    for ax in fig.axes:
        ax.legend(fontsize=8)
    note = f", {df['note'].iloc[0]}" if df["note"].iloc[0] else ""
    fig.suptitle(f"{what} at scale — {df['machine'].iloc[0]}{note}", fontsize=9)
    save_figure(fig, path)


def _plot_command(df: pd.DataFrame, part: str, path: Path) -> None:
    fig = new_figure(figsize=(11, 4))
    seconds_ax, memory_ax = fig.subplots(1, 2)
    for mode, rows in df.groupby("mode"):
        seconds_ax.plot(rows["layers"], rows["seconds"] / 60, "o-", label=mode)
        memory_ax.plot(rows["layers"], rows["peak_gb"], "o-", label=f"{mode}: peak resident memory")
    memory_ax.plot(df["layers"], df["checkpoint_gb"], "k--", label="checkpoint size")
    seconds_ax.set(xlabel="layers", ylabel="minutes", title=f"{part}: compress time")
    memory_ax.set(xlabel="layers", ylabel="GB", title=f"{part}: the command's peak resident memory")
    _finish(fig, df, "python -m panther_lite compress", path)


def _run_command_part(part: str, args, environment: dict) -> None:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    environment = {**environment, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rows = []
    for case in command_cases(part, args.quick, args.depths, args.modes):
        trace = args.work_dir / f"trace_{part}.csv"
        rows += run_command_case(case, args.work_dir, environment, trace, args.calibration_device)
        df = pd.DataFrame(rows)
        df["machine"], df["note"] = device_name("cpu"), args.note
        df["malloc_mmap_threshold"] = environment.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
        df.to_csv(args.output_dir / f"convert_scale_{part}.csv", index=False)
    _plot_command(df, part, args.output_dir / f"convert_scale_{part}.png")


def _plot(df: pd.DataFrame, part: str, path: Path) -> None:
    fig = new_figure(figsize=(11, 4))
    seconds_ax, memory_ax = fig.subplots(1, 2)
    for mode, rows in df.groupby("mode"):
        seconds_ax.plot(rows["layers"], rows["seconds"], "o-", label=mode)
        memory_ax.plot(rows["layers"], rows["added_gb"], "o-", label=mode)
        if "new_layers_gb" in rows:
            working = rows["added_gb"] - rows["new_layers_gb"]
            memory_ax.plot(rows["layers"], working, "x:", label=f"{mode}: without the new layers")
    memory_ax.plot(df["layers"], df["model_gb"], "k--", label="model size")
    seconds_ax.set(xlabel="layers", ylabel="convert time (s)", title=f"{part}: time")
    memory_ax.set(xlabel="layers", ylabel="GB", title=f"{part}: memory added during convert")
    _finish(fig, df, "panther_lite.convert", path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, nargs="+", default=["depth"])
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the tests)")
    parser.add_argument("--depths", type=int, nargs="+", default=list(STREAMED_DEPTHS),
                        help="the streamed part's TinyLlama depths")
    parser.add_argument("--modes", nargs="+", choices=COMMAND_MODES, default=list(COMMAND_MODES),
                        help="the streamed part's modes")
    parser.add_argument("--default-malloc", action="store_true", help="no MALLOC_MMAP_THRESHOLD_ in the cases")
    parser.add_argument("--calibration-device", default="cpu",
                        help="where the statistics and the block at work live, e.g. cuda (the model stays on the CPU)")
    parser.add_argument("--note", default="", help="how loaded the machine was (written to the CSV)")
    parser.add_argument("--work-dir", type=Path, default=Path("benchmarks/out/checkpoints"),
                        help="where the command parts write their checkpoints (13.5 GB for llama7b) and outputs")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case (JSON) in this process
    args = parser.parse_args(argv)
    tokens = 16 if args.quick else 256
    if args.case:
        print(json.dumps(run_case(json.loads(args.case), tokens, args.calibration_device)))
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ) if args.default_malloc else {**os.environ, **RECOMMENDED_MALLOC}
    for part in args.part:
        if part in COMMAND_PARTS:
            _run_command_part(part, args, environment)
            continue
        rows = []
        for case in cases(part, args.quick):
            command = [sys.executable, __file__, "--case", json.dumps(case), "--calibration-device", args.calibration_device]
            command += ["--quick"] if args.quick else []
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
            rows.append({**json.loads(done.stdout.strip().splitlines()[-1]),
                         "malloc_mmap_threshold": environment.get("MALLOC_MMAP_THRESHOLD_", "glibc default")})
            print(part, rows[-1], flush=True)
            df = pd.DataFrame(rows)  # written after every case: a long run leaves what it measured
            df["machine"] = device_name("cpu")
            df["note"] = args.note
            df.to_csv(args.output_dir / f"convert_scale_{part}.csv", index=False)
        _plot(df, part, args.output_dir / f"convert_scale_{part}.png")


if __name__ == "__main__":
    main()
