"""The digits task shared by benchmarks and tutorials: one loader and train/test split of
scikit-learn's bundled 8×8 digits (no download), dense or sketched classifiers, one
training loop and the test accuracy."""
from __future__ import annotations

import contextlib
from typing import Collection, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..extras import require
from ..nn import SKConv2d, SKLinear
from .environment import DeviceLike, as_device, check_int, check_non_negative, ignore_size_warnings

NUM_FEATURES = 64
NUM_CLASSES = 10


class LabelledData(NamedTuple):
    """Inputs ``x`` (n × 64, pixels scaled to [0, 1]) and class labels ``y`` (n, int64)."""

    x: Tensor
    y: Tensor


def load_digits_split(
    *, test_fraction: float = 0.25, seed: int = 0, device: DeviceLike = "cpu"
) -> Tuple[LabelledData, LabelledData]:
    """``(train, test)``: the 1,797 digits (flattened 8×8 images, pixels / 16) split at random.

    Args:
        test_fraction: share of the samples held out for testing, in (0, 1).
        seed: seeds the permutation (drawn on the CPU: the same split on every device).
        device: where the tensors are placed.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    load_digits = require("sklearn.datasets", "the digits task").load_digits

    device = as_device(device)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).div_(16.0)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return LabelledData(x[train].to(device), y[train].to(device)), LabelledData(x[test].to(device), y[test].to(device))


def mlp_classifier(
    widths: Sequence[int],
    *,
    num_terms: Optional[int] = None,
    low_rank: Optional[int] = None,
    sketched: Optional[Collection[int]] = None,
    seed: int = 0,
) -> nn.Sequential:
    """An MLP ``widths[0] → … → widths[-1]`` with ReLU between layers (the head, the last
    ``nn.Linear``, is module ``str(2 · (len(widths) − 2))``).

    With ``num_terms`` and ``low_rank`` the layers whose indices are in ``sketched``
    (default: every layer but the head, which sketching would not shrink) are
    ``SKLinear`` with ``init="sketch"``, the ``j``-th of them seeded with ``seed + j``.
    Weights are initialised from ``seed`` without touching the global random state.
    """
    if len(widths) < 2:
        raise ValueError(f"widths must hold at least an input and an output width, got {list(widths)}")
    for width in widths:
        check_int("every width", width, 1)
    _check_sketch(num_terms, low_rank)
    num_layers = len(widths) - 1
    sketched = set(range(num_layers - 1) if sketched is None else sketched) if num_terms is not None else set()
    layers: List[nn.Module] = []
    with _seeded(seed):
        for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            if index in sketched:
                term_seed = seed + sorted(sketched).index(index)
                layers.append(SKLinear(fan_in, fan_out, num_terms, low_rank, seed=term_seed))
            else:
                layers.append(nn.Linear(fan_in, fan_out))
            if index < num_layers - 1:
                layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def cnn_classifier(
    width: int, *, num_terms: Optional[int] = None, low_rank: Optional[int] = None, seed: int = 0
) -> nn.Sequential:
    """A CNN on the 8×8 digits (input n × 64): a 3×3 convolution to ``width`` channels, a
    3×3 ``width → width`` convolution (an ``SKConv2d`` with ``num_terms``/``low_rank``,
    trained from scratch), 2×2 average pooling and a linear head. Initialised from
    ``seed`` without touching the global random state."""
    check_int("width", width, 1)
    _check_sketch(num_terms, low_rank)
    with _seeded(seed):
        middle = (
            nn.Conv2d(width, width, 3, padding=1)
            if num_terms is None
            else SKConv2d(width, width, 3, padding=1, num_terms=num_terms, low_rank=low_rank, seed=seed)
        )
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            middle,
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * width, NUM_CLASSES),
        )


def _check_sketch(num_terms: Optional[int], low_rank: Optional[int]) -> None:
    if (num_terms is None) != (low_rank is None):
        raise ValueError("give both num_terms and low_rank (sketched) or neither (dense)")


@contextlib.contextmanager
def _seeded(seed: int):
    """The CPU generator seeded with ``seed`` for the layer inits inside, the global random
    state restored after, CUDA's generators untouched (``torch.manual_seed`` would reseed
    them), and the layers' size warnings silenced."""
    with torch.random.fork_rng(devices=[]), ignore_size_warnings():
        torch.default_generator.manual_seed(seed)
        yield


def train_classifier(
    model: nn.Module,
    data: Tuple[Tensor, Tensor],
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> List[float]:
    """Train ``model`` in place with AdamW and cross-entropy on shuffled mini-batches of
    ``data = (x, y)``; returns the mean training loss of each epoch and leaves the model
    in eval mode. Only parameters with ``requires_grad`` are optimised. The shuffles are
    drawn from ``seed`` on the CPU (the global random state is not used)."""
    check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    check_non_negative("lr", lr)
    check_non_negative("weight_decay", weight_decay)
    x, y = data
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        total = torch.zeros((), device=x.device)
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            batch = batch.to(x.device)
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(batch)
        losses.append(float(total) / len(y))
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, data: Tuple[Tensor, Tensor]) -> float:
    """Fraction of ``data = (x, y)`` that ``model`` (put in eval mode) classifies correctly."""
    x, y = data
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def digits_task_accuracy(
    layer: str = "linear",
    num_terms: Optional[int] = None,
    low_rank: Optional[int] = None,
    *,
    width: int = 128,
    epochs: int = 20,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    device: DeviceLike = "cpu",
) -> float:
    """Test accuracy (fraction in [0, 1]) of a small model trained on the digits.

    ``layer="linear"``: an MLP 64 → width → width → 10 whose middle layer is an
    ``SKLinear(width, width, num_terms, low_rank)``; ``layer="conv2d"``: a CNN on the 8×8
    images whose middle 3×3 convolution (width → width channels) is an ``SKConv2d``.
    ``num_terms=None`` trains the dense model. :func:`load_digits_split` (25% test),
    :func:`train_classifier` (AdamW without weight decay, i.e. Adam), seeded split and init.
    """
    if layer not in ("linear", "conv2d"):
        raise ValueError(f"layer must be 'linear' or 'conv2d', got {layer!r}")
    _check_sketch(num_terms, low_rank)
    check_int("width", width, 1)
    device = as_device(device)
    train, test = load_digits_split(seed=seed, device=device)
    sketch = dict(num_terms=num_terms, low_rank=low_rank, seed=seed)
    if layer == "linear":
        model = mlp_classifier([NUM_FEATURES, width, width, NUM_CLASSES], sketched=[1], **sketch)
    else:
        model = cnn_classifier(width, **sketch)
    train_classifier(model.to(device), train, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
    return accuracy(model, test)
