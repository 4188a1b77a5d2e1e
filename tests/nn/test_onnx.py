"""ONNX export of the sketched layers with both exporters (TorchScript-based and dynamo):
the graph runs in onnxruntime at other batch/sequence/spatial sizes than the example's,
matches PyTorch to 1e-4 relative, and keeps the low rank (two products per layer,
initializers the size of the stored factors, no dense weight)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import numpy_helper  # noqa: E402

from panther_lite.nn import SKConv1d, SKConv2d, SKConv3d, SKLinear  # noqa: E402

RELATIVE_TOLERANCE = 1e-4
INITIALIZER_BUDGET = 1.1  # graph weights at most 1.1× the layer's stored factors


def _linear(bias: bool = True) -> SKLinear:
    return SKLinear(24, 40, num_terms=2, low_rank=3, bias=bias, seed=0)


# (name, layer factory, example input, dynamic dims of the input, product op, products expected)
CASES = [
    ("linear_3d", _linear, (3, 5, 24), (0, 1), "MatMul", 2),
    ("linear_no_bias", lambda: _linear(bias=False), (4, 24), (0,), "MatMul", 2),
    ("conv1d_reflect", lambda: SKConv1d(3, 16, 3, padding=1, num_terms=1, low_rank=2, padding_mode="reflect", seed=0),
     (2, 3, 9), (0, 2), "Conv", 2),
    ("conv2d", lambda: SKConv2d(3, 16, 3, padding=1, num_terms=1, low_rank=2, seed=0), (2, 3, 8, 8), (0, 2, 3), "Conv", 2),
    ("conv3d_strided", lambda: SKConv3d(3, 8, 3, stride=2, padding=1, num_terms=1, low_rank=2, seed=0),
     (2, 3, 5, 6, 7), (0, 2), "Conv", 2),
]


def export(module: nn.Module, example: torch.Tensor, dims, path, dynamo: bool):
    """``torch.onnx.export`` as a user calls it, with the ``dims`` of the input dynamic."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and progress notes
        if dynamo:
            shapes = ({d: torch.export.Dim.DYNAMIC for d in dims},)
            torch.onnx.export(module, (example,), str(path), dynamo=True, input_names=["x"], dynamic_shapes=shapes)
        else:
            axes = {"x": {d: f"dim{d}" for d in dims}}
            torch.onnx.export(module, (example,), str(path), dynamo=False, input_names=["x"], dynamic_axes=axes)
    return onnx.load(str(path))


def float_initializer_numel(model) -> int:
    """Entries of the graph's floating-point weights (shape constants left out)."""
    arrays = [numpy_helper.to_array(init) for init in model.graph.initializer]
    return sum(a.size for a in arrays if np.issubdtype(a.dtype, np.floating))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def run_onnx(path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def stored_numel(module: nn.Module) -> int:
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name, make, shape, dims, product, count", CASES, ids=[c[0] for c in CASES])
def test_export_runs_in_onnxruntime_and_keeps_the_low_rank(tmp_path, dynamo, name, make, shape, dims, product, count):
    layer = make().eval()
    graph = export(layer, torch.randn(shape), dims, tmp_path / f"{name}.onnx", dynamo)

    # another size along every dynamic dimension
    x = torch.randn([size + 2 if d in dims else size for d, size in enumerate(shape)])
    with torch.no_grad():
        expected = layer(x).numpy()
    assert relative_error(run_onnx(tmp_path / f"{name}.onnx", x), expected) <= RELATIVE_TOLERANCE

    ops = [node.op_type for node in graph.graph.node]
    assert ops.count(product) == count and "Gemm" not in ops
    assert float_initializer_numel(graph) <= INITIALIZER_BUDGET * stored_numel(layer)
    dense_shape = tuple(layer.dense_weight_shape)
    assert all(tuple(init.dims) not in (dense_shape, dense_shape[::-1]) for init in graph.graph.initializer)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_exported_model_of_several_layers_matches_pytorch(tmp_path, dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(_linear(), nn.GELU(), SKLinear(40, 8, num_terms=1, low_rank=2, seed=1)).eval()
    export(model, torch.randn(2, 24), (0,), tmp_path / "mlp.onnx", dynamo)
    x = torch.randn(7, 24)
    with torch.no_grad():
        expected = model(x).numpy()
    assert relative_error(run_onnx(tmp_path / "mlp.onnx", x), expected) <= RELATIVE_TOLERANCE


def test_eager_calls_after_export_still_use_the_fast_path(tmp_path):
    # the export route is taken only while exporting: afterwards grads flow through the custom op
    layer = _linear()
    export(layer, torch.randn(2, 24), (0,), tmp_path / "linear.onnx", dynamo=False)
    x = torch.randn(3, 24, requires_grad=True)
    layer(x).sum().backward()
    assert layer.S1.grad is not None and x.grad is not None
