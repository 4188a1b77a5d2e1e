"""Deployment measurements: a model's deployable forms (dense fp32, converted, frozen + int8)
in PyTorch and in onnxruntime — their size on disk, their outputs and callables to time.

The int8 forms use each runtime's own dynamic quantizer: ``torch.ao.quantization.quantize_dynamic``
on the frozen model in PyTorch, ``onnxruntime.quantization.quantize_dynamic`` on the frozen
model's ONNX graph in onnxruntime (PyTorch's quantized modules do not export to ONNX).
onnx and onnxruntime are imported only by the functions that need them.
"""
from __future__ import annotations

import copy
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from ..conversion import convert, freeze
from ..extras import require
from .plots import new_figure, save_figure
from .timing import Spread, time_interleaved

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DEPLOY_FORMS",
    "DEPLOY_COLUMNS",
    "deployable_forms",
    "deploy_rows",
    "plot_deploy",
    "export_onnx",
    "quantize_onnx_int8",
    "onnx_runner",
    "saved_size_bytes",
]

DEPLOY_FORMS = ("dense fp32", "dense int8", "converted", "frozen", "frozen + int8")
DEPLOY_COLUMNS = ("form", "runtime", "size_mb", "latency_ms", "latency_iqr_ms", "quality")
# the fp32 graph each onnxruntime int8 form quantizes (PyTorch's quantized modules do not export)
_ONNX_INT8_SOURCE = {"dense int8": "dense fp32", "frozen + int8": "frozen"}
PathLike = Union[str, Path]


def _quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """``quantize_dynamic`` of every ``nn.Linear`` with per-output-channel int8 weights (a
    per-tensor scale loses more on the frozen pairs, whose rows differ in scale)."""
    with warnings.catch_warnings():
        # torch.ao's deprecation notes: this form measures PyTorch's own int8 modules on purpose
        # (the docs recommend torchao's quantize_ to users)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8)


def deployable_forms(dense: nn.Module, **convert_kwargs) -> Dict[str, nn.Module]:
    """The forms of ``dense`` (left unchanged) named in :data:`DEPLOY_FORMS`, each in eval mode:
    the dense model and its int8 ``quantize_dynamic``, a copy converted with
    ``panther_lite.convert(**convert_kwargs)``, that copy frozen, and frozen + int8."""
    dense = dense.eval()
    converted = copy.deepcopy(dense)
    convert(converted, **convert_kwargs)
    frozen = freeze(copy.deepcopy(converted)).eval()
    return {
        "dense fp32": dense,
        "dense int8": _quantize_dynamic_int8(copy.deepcopy(dense)),
        "converted": converted.eval(),
        "frozen": frozen,
        "frozen + int8": _quantize_dynamic_int8(copy.deepcopy(frozen)),
    }


def saved_size_bytes(model: nn.Module, path: PathLike) -> int:
    """Bytes of ``torch.save(model.state_dict(), path)`` (quantized modules' packed weights
    included; a sketched layer's fixed U sketches too)."""
    path = Path(path)
    torch.save(model.state_dict(), path)
    return path.stat().st_size


def export_onnx(
    model: nn.Module,
    example_inputs: Tuple[Tensor, ...],
    path: PathLike,
    input_names: Sequence[str],
    dynamic_axes: Mapping[str, Mapping[int, str]],
    *,
    dynamo: bool = False,
) -> Path:
    """``torch.onnx.export`` of ``model`` with the named dynamic axes of each input (the
    TorchScript-based exporter, or the dynamo one with ``dynamo=True``); returns ``path``.
    Exporter notes (deprecations, progress) are silenced."""
    path = Path(path)
    require("onnxscript" if dynamo else "onnx", "export_onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            shapes = {name: {axis: torch.export.Dim.DYNAMIC for axis in dynamic_axes.get(name, {})}
                      for name in input_names}
            torch.onnx.export(model, tuple(example_inputs), str(path), dynamo=True, input_names=list(input_names),
                              dynamic_shapes=tuple(shapes.values()))
        else:
            torch.onnx.export(model, tuple(example_inputs), str(path), dynamo=False, input_names=list(input_names),
                              dynamic_axes={name: dict(axes) for name, axes in dynamic_axes.items()})
    return path


def quantize_onnx_int8(source: PathLike, target: PathLike) -> Path:
    """onnxruntime's dynamic int8 quantization of the ONNX graph at ``source`` (its ``MatMul``
    and ``Gemm`` weights, per output channel, in 7 bits; activations quantized per call), written
    to ``target``. The 7 bits (``reduce_range``): on an x86 CPU without VNNI onnxruntime multiplies
    uint8 by int8 into saturating int16 pairs, which cost a 2-core AMD EPYC with AVX2 only 0.978
    output cosine on the deploy tests' MLP against 0.99985 with them."""
    quantization = require("onnxruntime.quantization", "quantize_onnx_int8")
    QuantType, quantize_dynamic = quantization.QuantType, quantization.quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
    return Path(target)


def onnx_runner(
    path: PathLike, *, threads: Optional[int] = None, provider: str = "CPUExecutionProvider"
) -> Callable[..., Tensor]:
    """``run(*inputs) -> Tensor``: the graph's first output for tensor inputs given in the
    graph's input order, on onnxruntime's ``provider`` (``threads``: its intra-op threads;
    default: onnxruntime's). Its threads do not spin between calls: spinning would take the
    cores from whatever runs next (PyTorch, in an interleaved comparison). A provider this
    onnxruntime build lacks is an error, not a silent fall back to the CPU."""
    onnxruntime = require("onnxruntime", "onnx_runner")

    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        options.intra_op_num_threads = threads
    if provider not in onnxruntime.get_available_providers():
        available = onnxruntime.get_available_providers()
        raise ValueError(f"provider {provider!r} is not in this onnxruntime build (it has {available})")
    session = onnxruntime.InferenceSession(str(path), options, providers=[provider])
    names = [item.name for item in session.get_inputs()]

    def run(*inputs: Tensor) -> Tensor:
        feed = {name: tensor.detach().cpu().numpy() for name, tensor in zip(names, inputs)}
        return torch.from_numpy(session.run(None, feed)[0])

    return run


def _runners(
    forms: Mapping[str, nn.Module], inputs: Tuple[Tensor, ...], input_names: Sequence[str],
    dynamic_axes: Mapping[str, Mapping[int, str]], workdir: Path,
) -> Dict[Tuple[str, str], Tuple[Callable[..., Tensor], float]]:
    """``(form, runtime) -> (run, size in MB)`` for every form in PyTorch and onnxruntime."""
    runners = {}
    graphs: Dict[str, Path] = {}
    for form in DEPLOY_FORMS:
        module = forms[form]
        size = saved_size_bytes(module, workdir / f"{form}.pt") / 1e6
        runners[(form, "pytorch")] = (torch.inference_mode()(module), size)
        if form in _ONNX_INT8_SOURCE:
            graph = quantize_onnx_int8(graphs[_ONNX_INT8_SOURCE[form]], workdir / f"{form}.onnx")
        else:
            graph = export_onnx(module, inputs, workdir / f"{form}.onnx", input_names, dynamic_axes)
        graphs[form] = graph
        run = onnx_runner(graph, threads=torch.get_num_threads())
        runners[(form, "onnxruntime")] = (run, graph.stat().st_size / 1e6)
    return runners


def deploy_rows(
    forms: Mapping[str, nn.Module],
    inputs: Tuple[Tensor, ...],
    input_names: Sequence[str],
    dynamic_axes: Mapping[str, Mapping[int, str]],
    quality: Callable[[Callable[..., Tensor]], float],
    *,
    repeats: int = 20,
) -> List[dict]:
    """One row (:data:`DEPLOY_COLUMNS`) per form of :func:`deployable_forms` and runtime
    (``"pytorch"``, ``"onnxruntime"``): size on disk (MB), median latency of ``run(*inputs)``
    and its interquartile range (ms; calls interleaved across all forms and runtimes, torch
    and onnxruntime on ``torch.get_num_threads()`` threads), and ``quality(run)``, for
    ``run(*inputs) -> output`` of that form (e.g. test accuracy, cosine to the dense output).
    ONNX graphs are exported with ``input_names`` and ``dynamic_axes`` in a temporary folder."""
    with tempfile.TemporaryDirectory() as workdir:
        runners = _runners(forms, tuple(inputs), input_names, dynamic_axes, Path(workdir))
        calls = {f"{form} / {runtime}": (lambda run=run: run(*inputs)) for (form, runtime), (run, _) in runners.items()}
        samples = time_interleaved(calls, repeats=repeats)
        rows = []
        for (form, runtime), (run, size) in runners.items():
            spread = Spread.of(samples[f"{form} / {runtime}"])
            rows.append(dict(form=form, runtime=runtime, size_mb=size, latency_ms=spread.median,
                             latency_iqr_ms=spread.iqr, quality=quality(run)))
    return rows


def plot_deploy(df: "pd.DataFrame", path: PathLike, *, quality_label: str = "quality", title: str = "") -> Path:
    """Size, latency and quality of each form (rows of :func:`deploy_rows`, one panel row per
    distinct ``model`` column when there is one) as horizontal bars per runtime; saves a PNG
    (without pyplot: :func:`~panther_lite.benchmark.new_figure`)."""
    groups = list(df.groupby("model", sort=False)) if "model" in df else [(title, df)]
    fig = new_figure(figsize=(15, 3.4 * len(groups)))
    axes = fig.subplots(len(groups), 3, squeeze=False)
    forms = list(DEPLOY_FORMS)
    for row, (name, part) in zip(axes, groups):
        label = part["metric"].iloc[0] if "metric" in part else quality_label
        for ax, column, xlabel in zip(row, ("size_mb", "latency_ms", "quality"),
                                      ("size on disk (MB)", "CPU latency per call (ms)", label)):
            for offset, runtime, color in ((0.2, "pytorch", "tab:orange"), (-0.2, "onnxruntime", "tab:blue")):
                values = part[part["runtime"] == runtime].set_index("form")[column].reindex(forms)
                ax.barh([-i + offset for i in range(len(forms))], values, height=0.4, color=color, label=runtime)
            ax.set_yticks([-i for i in range(len(forms))], forms)
            ax.set_xlabel(xlabel)
            ax.set_title(name, fontsize=9)
            if column == "quality":
                ax.set_xlim(max(0.0, part["quality"].min() - 0.05), 1.0)
        row[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
