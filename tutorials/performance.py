"""Tutorial: performance of sketched layers — timing, memory, tensor cores, mixed
precision, profiling and compiling.

Sections (each prints what it measured; plots go to ``--output-dir``):

1. Timing done right: the naive wall-clock way (no warm-up, no synchronisation — on a GPU
   it measures kernel *launches*, not kernels) against
   :func:`panther_lite.benchmark.time_callable` (warm-up, then the median of repeats,
   each bracketed by CUDA events on a GPU), used for every number that follows; then
   ``SKLinear`` against the anchor's (Panther's) per-term formulation
   (:func:`~panther_lite.benchmark.anchor_linear`).
2. Memory, with :mod:`panther_lite.benchmark`'s helpers: parameters trainable vs stored
   and their bytes (:func:`~panther_lite.benchmark.parameter_bytes`), the activations
   autograd saves for backward (:func:`~panther_lite.benchmark.saved_activation_bytes`),
   the training-forward footprint (:func:`~panther_lite.benchmark.training_memory_bytes`:
   the allocator's peak on CUDA, parameters + saved activations on the CPU), and the
   ``L × batch × out`` per-term outputs the anchor's formulation materialises.
3. Tensor-core alignment: :func:`~panther_lite.nn.tensor_core_multiple`,
   :func:`~panther_lite.nn.align_rank`, :func:`~panther_lite.nn.select_config`, and the
   time of an aligned against an unaligned rank.
4. Mixed-precision training with ``torch.autocast`` (bf16) and fp16 with
   ``torch.amp.GradScaler`` (the current spellings; ``torch.cuda.amp`` is deprecated).
5. Profiling a training step with ``torch.profiler`` (a Chrome trace is saved); the
   custom op is looked up by name in ``key_averages()`` (a table sorted by time shows
   whichever rows were slowest in that run).
6. Compiling for production with ``torch.compile(fullgraph=True)``.

Sizes follow the device: on a GPU width 4096, batch 1024 (seconds); on the CPU width 1024,
batch 128 and fewer repeats and steps (about a minute on 2 cores); ``--quick``: tiny sizes,
seconds anywhere; ``--width`` and ``--batch-size`` override.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from panther_lite.benchmark import (
    anchor_linear,
    forward_step,
    new_figure,
    parameter_bytes,
    save_figure,
    saved_activation_bytes,
    time_callable,
    training_memory_bytes,
)
from panther_lite.nn import SKLinear, align_rank, select_config, tensor_core_multiple

CUSTOM_OP = "panther_lite::sketched_linear"
# per device: layer width, batch rows, untimed and timed calls, training steps
SIZES = {
    "cuda": dict(width=4096, batch=1024, warmup=10, repeats=50, steps=30),
    "cpu": dict(width=1024, batch=128, warmup=2, repeats=10, steps=10),
    "quick": dict(width=128, batch=32, warmup=1, repeats=5, steps=3),
}


def naive_ms(fn, repeats):
    """The common mistake, shown for contrast (every other number here comes from
    :func:`~panther_lite.benchmark.time_callable`): wall-clock around the calls, no
    warm-up, no synchronisation."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1e3 / repeats


def section_timing(device, width, batch, num_terms, low_rank, warmup, repeats):
    print("== 1. Timing done right ==")
    layer = SKLinear(width, width, num_terms, low_rank, device=device, seed=0)
    anchor = anchor_linear(layer)
    x = torch.randn(batch, width, device=device)

    forward = forward_step(layer, x)
    naive = naive_ms(forward, repeats)
    proper = time_callable(forward, device=device, warmup=warmup, repeats=repeats)
    how = "CUDA events around each call, synchronised" if device.type == "cuda" else "perf_counter around each call"
    print(f"naive wall clock (first calls included, no sync): {naive:.3f} ms")
    print(f"time_callable (warm-up, median; {how}): {proper:.3f} ms")
    if device.type == "cuda":
        print("on a GPU the naive number is the time to *launch* the kernels; CUDA events time the kernels")
    anchor_ms = time_callable(forward_step(anchor, x), device=device, warmup=warmup, repeats=repeats)
    print(
        f"SKLinear(L={num_terms}, k={low_rank}) {proper:.3f} ms vs the anchor's per-term formulation "
        f"{anchor_ms:.3f} ms: {anchor_ms / proper:.2f}x"
    )
    return {"naive": naive, "time_callable": proper, "anchor (per-term)": anchor_ms}


def section_memory(device, width, batch, num_terms, low_rank):
    """Bytes of ``nn.Linear`` and ``SKLinear`` (``width × width``, input ``batch × width``).

    Returns ``(rows, per_term)``: ``rows[name]`` holds ``"parameters"``, ``"saved"`` and
    ``"training"`` bytes for ``"nn.Linear"`` and ``"SKLinear"``; ``per_term`` is the bytes
    of the anchor formulation's ``L × batch × out`` per-term outputs."""
    print("\n== 2. Memory ==")
    x = torch.randn(batch, width, device=device, requires_grad=True)
    dense = nn.Linear(width, width, device=device)
    layer = SKLinear(width, width, num_terms, low_rank, device=device, seed=0)
    counts = layer.parameter_counts()
    print(f"nn.Linear stores {sum(p.numel() for p in dense.parameters()):,} parameters")
    print(f"SKLinear(L={num_terms}, k={low_rank}): {counts.trainable:,} trainable, {counts.stored:,} stored (U buffers)")
    rows = {}
    for name, module in (("nn.Linear", dense), ("SKLinear", layer)):
        tensors = list(module.parameters()) + list(module.buffers())
        rows[name] = {
            "parameters": parameter_bytes(module),
            "saved": saved_activation_bytes(lambda module=module: module(x), tensors),
            "training": training_memory_bytes(module, x),
        }
        print(
            f"{name:>9}: parameters+buffers {rows[name]['parameters'] / 2**20:.3f} MiB, saved for backward "
            f"{rows[name]['saved'] / 2**20:.3f} MiB, training forward {rows[name]['training'] / 2**20:.3f} MiB"
        )
    per_term = num_terms * batch * width * x.element_size()
    print(
        f"the anchor's formulation also materialises L × batch × out = {per_term / 2**20:.3f} MiB of per-term "
        "outputs in every forward (transient: they raise the peak, not the saved bytes)"
    )
    print(
        "training forward = "
        + ("the CUDA allocator's peak + parameters" if device.type == "cuda" else "parameters + saved activations (CPU)")
    )
    return rows, per_term


def section_tensor_cores(device, width, batch, warmup, repeats):
    print("\n== 3. Tensor-core alignment ==")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    multiple = tensor_core_multiple(dtype)
    print(f"tensor_core_multiple({dtype}) = {multiple}; bf16/fp16 want 8, int8/fp8 16, tf32 4")
    print(f"align_rank(67, 8) = {align_rank(67, 8)}  (rounded down, never to 0: align_rank(5, 8) = {align_rank(5, 8)})")
    config = select_config(width, width, param_ratio=0.25, dtype=dtype)
    print(f"select_config({width}, {width}, param_ratio=0.25, dtype={dtype}) = {config}  (num_terms, low_rank)")
    aligned = max(multiple, align_rank(width // 16, multiple))
    x = torch.randn(batch, width, device=device, dtype=dtype)
    times = {}
    for rank in (aligned, aligned + 1):
        layer = SKLinear(width, width, 1, rank, device=device, dtype=dtype, seed=0)
        times[rank] = time_callable(forward_step(layer, x), device=device, warmup=warmup, repeats=repeats)
        print(f"low_rank={rank:4d} ({'aligned' if rank % multiple == 0 else 'unaligned'}): {times[rank]:.3f} ms")
    if device.type != "cuda":
        print("(no tensor cores on a CPU: the difference here is only the extra rank)")
    return times


def train_steps(model, x, y, steps, device, dtype, scaler=None):
    """``steps`` optimizer steps under autocast at ``dtype``; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def model_and_data(device, width, batch, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        SKLinear(width, width, 1, width // 16, device=device, seed=seed),
        nn.GELU(),
        SKLinear(width, width, 1, width // 16, device=device, seed=seed + 1),
        nn.GELU(),
        nn.Linear(width, 10, device=device),
    )
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, x, y


def section_mixed_precision(device, width, batch, steps):
    print("\n== 4. Mixed-precision training ==")
    curves = {}
    model, x, y = model_and_data(device, width, batch)
    curves["bf16 autocast"] = train_steps(model, x, y, steps, device, torch.bfloat16)
    model, x, y = model_and_data(device, width, batch)
    scaler = torch.amp.GradScaler(device.type)
    curves["fp16 autocast + GradScaler"] = train_steps(model, x, y, steps, device, torch.float16, scaler)
    for name, losses in curves.items():
        print(f"{name:>27}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"GradScaler scale after {steps} steps: {scaler.get_scale():.0f}")
    return curves


def section_profiling(device, width, batch, output_dir):
    print("\n== 5. Profiling a training step ==")
    model, x, y = model_and_data(device, width, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # warm-up outside the profile
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(3):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=sort_by, row_limit=8))  # the rows and their order depend on timing
    calls = sum(event.count for event in events if event.key == CUSTOM_OP)
    print(f"the profiler saw the custom op {CUSTOM_OP} {calls} times (found by name, not by rank in the table)")
    trace = output_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    print(f"Chrome trace saved to {trace} (open in chrome://tracing or https://ui.perfetto.dev)")
    return calls


def section_compile(device, width, batch, warmup, repeats):
    print("\n== 6. Compiling for production ==")
    model, x, _ = model_and_data(device, width, batch)
    model.eval()
    mode = "max-autotune" if device.type == "cuda" else None
    compiled = torch.compile(model, mode=mode, fullgraph=True)  # fullgraph: fail loudly on graph breaks
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    eager = time_callable(forward_step(model, x, inference_mode=True), device=device, warmup=warmup, repeats=repeats)
    fast = time_callable(forward_step(compiled, x, inference_mode=True), device=device, warmup=warmup, repeats=repeats)
    print(f"eager {eager:.3f} ms, torch.compile(mode={mode!r}, fullgraph=True) {fast:.3f} ms; outputs equal")
    return {"eager": eager, "compiled": fast}


def default_sizes(device: torch.device, quick: bool = False) -> dict:
    """The :data:`SIZES` entry for ``device`` (a GPU's, else the CPU's; tiny with ``quick``)."""
    return SIZES["quick" if quick else "cuda" if device.type == "cuda" else "cpu"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds on a CPU")
    parser.add_argument("--output-dir", type=Path, default=Path("tutorial_outputs/performance"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, help="layer width (default: 4096 on a GPU, 1024 on the CPU)")
    parser.add_argument("--batch-size", type=int, help="input rows (default: 1024 on a GPU, 128 on the CPU)")
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    sizes = default_sizes(device, args.quick)
    width, batch = args.width or sizes["width"], args.batch_size or sizes["batch"]
    warmup, repeats, steps = sizes["warmup"], sizes["repeats"], sizes["steps"]

    num_terms, low_rank = 4, width // 32
    timings = section_timing(device, width, batch, num_terms, low_rank, warmup, repeats)
    memory, per_term = section_memory(device, width, batch, num_terms, low_rank)
    ranks = section_tensor_cores(device, width, batch, warmup, repeats)
    curves = section_mixed_precision(device, width, batch, steps)
    section_profiling(device, width, batch, args.output_dir)
    compiled = section_compile(device, width, batch, warmup, repeats)

    fig = new_figure(figsize=(18, 4))
    axes = fig.subplots(1, 4)
    panels = [
        (axes[0], timings, "ms", "forward time: method, anchor"),
        (axes[1], {**{k: v["training"] / 2**20 for k, v in memory.items()}, "anchor per-term\noutputs": per_term / 2**20},
         "MiB", "memory (training forward)"),
        (axes[2], {f"k={k}": v for k, v in ranks.items()}, "ms", "rank alignment"),
    ]
    for ax, values, ylabel, title in panels:
        ax.bar(list(values), list(values.values()))
        ax.set(ylabel=ylabel, title=title)
        ax.tick_params(axis="x", labelrotation=15)
    axes[0].set_yscale("log")  # the naive number can be orders of magnitude off
    for name, losses in curves.items():
        axes[3].plot(range(1, len(losses) + 1), losses, marker="o", label=name)
    axes[3].set(xlabel="step", ylabel="loss", title=f"mixed precision (compiled {compiled['compiled']:.2f} ms)")
    axes[3].legend()
    path = save_figure(fig, args.output_dir / "performance.png", dpi=100)
    print(f"\nplot saved to {path}")


if __name__ == "__main__":
    main()
