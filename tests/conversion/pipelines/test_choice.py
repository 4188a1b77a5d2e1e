"""The pipeline seam: choose_pipeline picks whole model or by blocks and says why; run_pipeline
runs any implementation; the by-blocks steps run each block alone only inside the materialise
hook (what a pipeline loading blocks from disk overrides) and give the default's model."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.workflows.convert import run_pipeline
from panther_lite.conversion.calibration.batches import CalibrationData
from panther_lite.conversion.pipelines import ByBlocks, Conversion, WholeModel, choose_pipeline
from panther_lite.conversion.planning.sizes import plan_uniform
from panther_lite.conversion.selection import mark_unconvertible, select_layers


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.act = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.ReLU()

    def forward(self, hidden):
        return hidden + self.down(self.act(self.up(hidden)))


class Stack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _job(model, data, **options):
    config = panther_lite.ConvertConfig(progress=False, **options)
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records)
    return Conversion(model, config, CalibrationData(data), records)


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 5, 16, generator=generator) for _ in range(3)]


@pytest.mark.parametrize(
    "data,options,kind,description",
    [
        (_batches(), {}, ByBlocks, "block pipeline: 3 blocks at layers"),
        (_batches(), dict(blocks=False), WholeModel, "whole model: blocks=False"),
        (None, {}, WholeModel, "whole model: no calibration data, so nothing runs block by block"),
        (lambda m: m(_batches()[0]), {}, WholeModel, "whole model: calibration_data is a callable or a one-shot"),
        ([], {}, WholeModel, "whole model: calibration_data holds no batch"),
    ],
)
def test_choose_pipeline_says_why(data, options, kind, description):
    pipeline = choose_pipeline(_job(Stack(), data, param_ratio=0.5, **options))
    assert isinstance(pipeline, kind) and pipeline.description.startswith(description)


def test_refine_on_the_whole_model_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="refine refines block by block, but this convert runs on the whole model: "):
        choose_pipeline(_job(Stack(), None, param_ratio=0.5, refine=True))


class HookedBlocks(ByBlocks):
    """A by-blocks pipeline that records which block is materialised and every block forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inside, self.events, self.gains_asked = None, [], 0

    @contextlib.contextmanager
    def materialise(self, index, block):
        self.events.append(("in", index))
        self.inside = index
        with super().materialise(index, block):
            yield
        self.inside = None

    def block_gains(self, blocks):
        self.gains_asked += 1
        return super().block_gains(blocks)


@pytest.mark.parametrize("options", [dict(param_ratio=0.5), dict(param_ratio=0.5, allocation="global", sequential=True)])
def test_each_block_runs_alone_only_inside_materialise_and_the_model_is_the_defaults(options):
    expected, model, data = Stack(), Stack(), _batches()
    expected_report = panther_lite.convert(expected, calibration_data=data, progress=False, **options)
    job = _job(model, data, **options)
    default = choose_pipeline(job)
    pipeline = HookedBlocks(default.block_list, default.description, job.config)
    forwards = []  # (block, block materialised) of each block forward, seen by its activation (never swapped)
    handles = [
        block.act.register_forward_pre_hook(lambda module, args, index=index: forwards.append((index, pipeline.inside)))
        for index, block in enumerate(model.layers)
    ]
    assert pipeline.capture(job) is None  # every batch through the whole model, each block inside its materialise
    assert pipeline.events == [("in", i) for i in range(3)] * len(data)
    assert forwards == [(i, i) for i in range(3)] * len(data)
    pipeline.events.clear()
    forwards.clear()
    notes = pipeline.plan(job)
    passes = 2 if options.get("allocation") == "global" else 1
    assert pipeline.gains_asked == passes - 1
    fit_forwards = len(forwards)
    pipeline.plan = lambda job: notes
    report, _ = run_pipeline(job, pipeline)
    for handle in handles:
        handle.remove()
    assert pipeline.events == [("in", i) for i in range(3)] * passes
    if passes == 1:  # no whole-model run before the check: every block forward is inside its own materialise
        steps = forwards[fit_forwards:]
        assert steps[: -3] and all(index == inside for index, inside in steps[:-3])  # the last 3: the run check
    assert report.attrs["pipeline"] == expected_report.attrs["pipeline"] == "block pipeline: 3 blocks at layers"
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert report.equals(expected_report)


def test_a_pipeline_loading_weights_later_can_select_and_size_a_meta_model():
    """The out-of-core seam: a skeleton on the meta device is selected (not skipped) and sized
    when its pipeline says it loads the weights itself; convert itself still skips meta layers."""
    with torch.device("meta"):
        model = Stack()
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records)
    assert {record.status for record in records} == {"skipped"}
    assert "meta device" in records[0].reason
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records, meta_loaded_later=True)
    assert {record.status for record in records} == {"converted"}
    config = panther_lite.ConvertConfig(param_ratio=0.5, progress=False)
    notes, pooled = plan_uniform(records, config)
    assert pooled == [] and [r.low_rank for r in records if r.to_convert] == [2, 2, 2, 2, 2, 2]
