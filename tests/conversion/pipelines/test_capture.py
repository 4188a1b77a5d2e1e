"""The block pipeline is exact or falls back and says why: blocks that change the shape of what
they pass on (CNN stages), per-block arguments that differ from batch to batch (sliding-window
masks), and hidden states passed by keyword run block by block and give the whole-model model
bit for bit; hooks on blocks, shared layers, in-place changes, tuple/keyword calls, other
outputs passed on, layers called across the blocks' boundary and ``sequential`` with a layer
before the blocks fall back to the whole model with the reason (a ``ValueError`` for a named
path); bad batches are named by their index and the layer they do not fit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.calibration.batches import CalibrationData
from panther_lite.conversion.pipelines import ByBlocks, Conversion
from panther_lite.conversion.pipelines.blocks import find_blocks
from panther_lite.conversion.selection import mark_unconvertible, select_layers

WIDTH, WINDOW = 16, 4

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, hidden, mask=None):
        out = hidden + self.down(torch.relu(self.up(hidden)))
        return out if mask is None else out * mask


class Stack(nn.Module):
    """Blocks (of ``block_class``) at ``layers`` run one after the other, then a head;
    subclasses change the blocks or how they are called."""

    block_class = Block

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(self.block_class() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


class Windowed(Stack):
    """Gemma-2-like: even blocks see a sliding-window mask, odd ones the full one; both are the
    same while the sequence fits the window."""

    def forward(self, x):
        positions = torch.arange(x.shape[1]).view(1, -1, 1)
        sliding, full = (positions < WINDOW).to(x.dtype), torch.ones_like(x[:1, :, :1])
        for index, block in enumerate(self.layers):
            x = block(x, sliding if index % 2 == 0 else full)
        return self.head(x)


class KeywordBlock(Block):
    def forward(self, hidden_states, mask=None):
        return super().forward(hidden_states, mask)


class ByKeyword(Stack):
    """Calls its blocks with ``hidden_states=`` (as transformers' decoder layers are)."""

    block_class = KeywordBlock

    def forward(self, x):
        for block in self.layers:
            x = block(hidden_states=x)
        return self.head(x)


class InPlaceBetween(Stack):
    def forward(self, x):
        for block in self.layers:
            x = block(x)
            x.mul_(0.5)
        return self.head(x)


class MaybeInPlace(Block):
    in_place = False

    def forward(self, hidden, mask=None):
        if self.in_place:
            hidden.mul_(0.5)
        return super().forward(hidden, mask)


class ChangesItsInput(Stack):
    """Block 1 halves its input in place (the output of block 0)."""

    block_class = MaybeInPlace

    def __init__(self) -> None:
        super().__init__()
        self.layers[1].in_place = True


class TupleBlock(Block):
    def forward(self, pair):
        hidden, scale = pair
        return super().forward(hidden) * scale


class ByTuple(Stack):
    block_class = TupleBlock

    def forward(self, x):
        for block in self.layers:
            x = block((x, 2.0))
        return self.head(x)


class ByOtherKeyword(Stack):
    def forward(self, x):
        for block in self.layers:
            x = block(hidden=x) if block is self.layers[0] else block(x)
        return self.head(x)


class DictBlock(Block):
    def forward(self, hidden, mask=None):
        return {"hidden": super().forward(hidden)}


class ReturnsDict(Stack):
    block_class = DictBlock

    def forward(self, x):
        for block in self.layers:
            x = block(x)["hidden"]
        return self.head(x)


class GateBlock(Block):
    def forward(self, hidden, gate=None):
        out = super().forward(hidden, gate)
        return out, torch.sigmoid(out.mean(-1, keepdim=True))


class PassesAnOutputOn(Stack):
    """Each block also returns a gate the next one receives (T5's position bias, in small)."""

    block_class = GateBlock

    def forward(self, x):
        gate = None
        for block in self.layers:
            x, gate = block(x, gate)
        return self.head(x)


class ComputesBetween(Stack):
    """Each block after the first receives a gate the model computes from the last output."""

    def forward(self, x):
        gate = None
        for block in self.layers:
            x = block(x, gate)
            gate = torch.sigmoid(x.mean(-1, keepdim=True))
        return self.head(x)


class ProjBlock(Block):
    def forward(self, hidden, proj=None):
        out = super().forward(hidden)
        return out + proj(out)


class CallsAnOutsideLayer(Stack):
    """Its blocks call a layer held outside them."""

    block_class = ProjBlock

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for block in self.layers:
            x = block(x, self.proj)
        return self.head(x)


class SkipsOnLongInputs(Stack):
    def forward(self, x):
        blocks = self.layers if x.shape[1] <= WINDOW else self.layers[:-1]
        for block in blocks:
            x = block(x)
        return self.head(x)


class EmbedsFirst(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return super().forward(self.embed(x))


class Stage(nn.Module):
    """A stride-2 stage: each halves the resolution (and may widen the channels)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv, self.mix = nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.Conv2d(cout, cout, 1)

    def forward(self, x):
        return self.mix(torch.relu(self.conv(x)))


class StridedStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList([Stage(3, 8), Stage(8, 16), Stage(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


def _batches(*lengths: int):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, length, WIDTH, generator=generator) for length in lengths]


def _images():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 16, 16, generator=generator) for _ in range(2)]


def _convert_both(model: nn.Module, batches, **options):
    """``(report, model)`` converted with ``blocks="auto"``, and the same with ``blocks=False``."""
    options = dict(param_ratio=0.5, calibration_data=batches, progress=False, **options)
    auto, whole = copy.deepcopy(model), copy.deepcopy(model)
    report = panther_lite.convert(auto, **options)
    panther_lite.convert(whole, blocks=False, **options)
    return report, auto, whole


def _assert_same_model(model: nn.Module, reference: nn.Module, batches) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with torch.no_grad():
        assert all(torch.equal(model(batch), reference(batch)) for batch in batches)


EXACT = {  # model, batches, the block list found, whether sequential runs by blocks too
    "per-block-masks": (Windowed, _batches(3, 8, 6), "3 blocks at layers", True),  # first batch inside the window
    "hidden-states-keyword": (ByKeyword, _batches(3, 8), "3 blocks at layers", True),
    "strided-stages": (StridedStages, _images(), "3 blocks at stages", True),
    # fed the dense model's inputs and arguments, exact; under sequential they fall back (below)
    "output-passed-on": (PassesAnOutputOn, _batches(3, 8), "3 blocks at layers", False),
    "computed-between": (ComputesBetween, _batches(3, 8), "3 blocks at layers", False),
    "layer-before-the-blocks": (EmbedsFirst, _batches(3, 8), "3 blocks at layers", False),
}


@pytest.mark.parametrize(
    "name, sequential",
    [(name, sequential) for name, case in EXACT.items() for sequential in (False, True)[: 1 + case[3]]],
)
def test_runs_block_by_block_and_gives_the_whole_model_bit_for_bit(name, sequential):
    build, batches, blocks, _ = EXACT[name]
    report, auto, whole = _convert_both(build(), batches, sequential=sequential)
    assert report.attrs["pipeline"] == f"block pipeline: {blocks}"
    assert (report["status"] == "converted").any()
    _assert_same_model(auto, whole, batches)


def _hooked() -> Stack:
    model = Stack()
    model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    return model


def _shared() -> Stack:
    model = Stack()
    model.layers[2].up = model.layers[0].up
    return model


FALLBACKS = {
    "hook-on-a-block": (_hooked, {}, "block 1 at layers has forward hooks, which replaying it would run again"),
    "shared-layer": (_shared, {}, "layer 'layers.0.up' is shared (in block 0 and in block 2 at layers)"),
    "in-place-between-blocks": (
        InPlaceBetween, {}, "the hidden states block 0 returned are changed in place before block 1 at layers runs"
    ),
    "block-changes-its-input": (ChangesItsInput, {}, "block 1 at layers changes its inputs"),
    "tuple-call": (ByTuple, {}, "block 0 at layers is called without a hidden-states tensor as its first argument"),
    "other-keyword": (ByOtherKeyword, {}, "block 0 at layers is called without a hidden-states tensor"),
    "returns-a-dict": (ReturnsDict, {}, "block 0 at layers returns a dict, not hidden states"),
    "sequential-output-passed-on": (
        PassesAnOutputOn, dict(sequential=True), "sequential=True feeds converted blocks to the next, but block 1 at "
        "layers receives a tensor made after the first block was called"
    ),
    "sequential-computed-between": (
        ComputesBetween, dict(sequential=True), "sequential=True feeds converted blocks to the next, but block 1"
    ),
    "outside-layer-called-inside": (CallsAnOutsideLayer, {}, "layer 'proj', outside the blocks, is called from block 0"),
    "skips-a-block-on-batch-1": (
        SkipsOnLongInputs, {}, "the model does not call every block at layers (calibration batch 1)"
    ),
    "sequential-after-a-layer": (EmbedsFirst, dict(sequential=True), "sequential=True converts layer 'embed', which"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_what_cannot_be_replayed_exactly_falls_back_with_the_reason(name):
    build, options, reason = FALLBACKS[name]
    batches = _batches(3, 8)
    report, auto, whole = _convert_both(build(), batches, **options)
    assert report.attrs["pipeline"].startswith("whole model: " + reason), report.attrs["pipeline"]
    _assert_same_model(auto, whole, batches)


def test_global_hooks_fall_back():
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        report, _, _ = _convert_both(Stack(), _batches(3))
    finally:
        handle.remove()
    assert report.attrs["pipeline"].startswith("whole model: global module forward hooks are registered")


def test_a_named_block_list_that_cannot_be_replayed_is_refused_and_the_model_left_as_it_was(assert_unchanged):
    model = _shared()
    state, types = {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"blocks='layers': layer 'layers.0.up' is shared .*; pass blocks=False"):
        panther_lite.convert(model, param_ratio=0.5, calibration_data=_batches(3), progress=False, blocks="layers")
    assert_unchanged(model, state, types)


def test_each_block_keeps_its_own_arguments_and_shared_ones_are_cached_once():
    model, batches = Windowed(), _batches(3, 8)
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records)
    config = panther_lite.ConvertConfig(param_ratio=0.5, progress=False)
    job = Conversion(model, config, CalibrationData(batches), records)
    pipeline = ByBlocks(find_blocks(model, records, "auto")[0], "", config)
    assert pipeline.capture(job) is None
    (first, second) = pipeline.captured.calls
    assert [len(calls) for calls in (first, second)] == [3, 3]
    masks = [call[0][1] for call in second]
    assert masks[0] is masks[2] and masks[0] is not masks[1]  # one sliding mask for blocks 0 and 2
    assert not torch.equal(masks[0], masks[1]) and torch.equal(first[0][0][1], first[1][0][1])
    assert torch.equal(pipeline.captured.first()[1], batches[1])
    assert all(call[0][0] is None for call in second[1:])  # later blocks' hidden states are not kept


@pytest.mark.parametrize("blocks", ["auto", False])
def test_bad_batches_name_their_index_and_the_layer(blocks):
    options = dict(param_ratio=0.5, progress=False, blocks=blocks)
    with pytest.raises(TypeError, match="calibration batch 1 is None"):
        panther_lite.convert(Stack(), calibration_data=[_batches(3)[0], None], **options)
    if blocks == "auto":  # the first batch decides nothing: it is checked like the others
        with pytest.raises(TypeError, match="calibration batch 0 is None"):
            panther_lite.convert(Stack(), calibration_data=[None, _batches(3)[0]], **options)
    narrow = torch.randn(2, 3, WIDTH - 4)
    batch = r".*calibration batch 1" if blocks == "auto" else ""
    with pytest.raises(ValueError, match=r"layer 'layers.0.up' expects inputs with last dimension" + batch):
        panther_lite.convert(Stack(), calibration_data=[_batches(3)[0], narrow], **options)


def test_no_batch_falls_back_and_says_so():
    with pytest.warns(UserWarning, match="calibration data never reached"):
        report = panther_lite.convert(Stack(), param_ratio=0.5, calibration_data=[], progress=False)
    assert report.attrs["pipeline"] == "whole model: calibration_data holds no batch"
