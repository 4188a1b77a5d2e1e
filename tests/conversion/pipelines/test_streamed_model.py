"""A checkpoint streamed for evaluation holds one block in memory at a time, or those its resident
budget keeps, and none after."""
from __future__ import annotations

import pytest
import torch

from panther_lite.conversion.pipelines.blocks import repeated_block_list
from panther_lite.conversion.pipelines.streamed_model import streamed_model

pytest.importorskip("transformers")


def _real_blocks(blocks) -> int:
    return sum(not next(block.parameters()).is_meta for block in blocks)


def test_each_block_is_read_while_it_runs_and_released_after(checkpoints):
    seen = []
    with streamed_model(checkpoints["llama"]) as model:
        blocks = repeated_block_list(model).blocks
        assert _real_blocks(blocks) == 0
        for block in blocks:
            block.register_forward_pre_hook(lambda module, args: seen.append(_real_blocks(blocks)))
        with torch.no_grad():
            logits = model(input_ids=torch.arange(5, 15)[None]).logits
        assert _real_blocks(blocks) == 0
    assert seen == [1] * len(blocks)
    assert torch.isfinite(logits).all()
    assert all(param.is_meta for param in model.parameters())


def _block_bytes(block) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters())


@pytest.mark.parametrize("kept", [0, 1, 2])  # the tiny LLaMA has 2 blocks: 2 keeps the whole model
def test_blocks_once_read_stay_within_the_resident_budget_and_compute_the_same(checkpoints, monkeypatch, kept):
    from panther_lite.conversion.pipelines import skeleton_parts

    with streamed_model(checkpoints["llama"]) as model, torch.no_grad():
        expected = model(input_ids=torch.arange(5, 15)[None]).logits
        sizes = [_block_bytes(block) for block in repeated_block_list(model).blocks]
    reads = []
    real_load = skeleton_parts.SkeletonParts.load
    monkeypatch.setattr(skeleton_parts.SkeletonParts, "load", lambda self, part: reads.append(part) or real_load(self, part))
    budget = sum(sizes[:kept]) + sizes[kept] - 1 if kept < len(sizes) else sum(sizes)  # one byte short of one more
    with streamed_model(checkpoints["llama"], resident_bytes=budget) as model, torch.no_grad():
        blocks = repeated_block_list(model).blocks
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=torch.arange(5, 15)[None]).logits, expected, rtol=0, atol=0)
        assert [not next(block.parameters()).is_meta for block in blocks] == [i < kept for i in range(len(blocks))]
    streamed = list(range(kept, len(sizes)))
    assert reads == [None] + list(range(len(sizes))) + streamed  # the kept ones read once, the others per call
    assert all(param.is_meta for param in model.parameters())


@pytest.mark.parametrize("budget", [-1, 1.5, "1e9", True])
def test_a_bad_resident_budget_is_named_and_nothing_is_read(checkpoints, monkeypatch, budget):
    from panther_lite.conversion.pipelines import streamed_model as streamed_module

    monkeypatch.setattr(streamed_module, "CheckpointFiles", lambda directory: pytest.fail("the checkpoint was read"))
    with pytest.raises(ValueError, match="resident_bytes"):
        with streamed_model(checkpoints["llama"], resident_bytes=budget):
            pass


def test_a_forward_that_fails_inside_a_block_releases_it(checkpoints):
    with streamed_model(checkpoints["llama"]) as model:
        blocks = repeated_block_list(model).blocks

        def fail(module, args):
            raise RuntimeError("boom")

        blocks[1].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            model(input_ids=torch.arange(5, 15)[None])
    assert all(param.is_meta for param in model.parameters())


def test_a_failed_forward_releases_the_kept_blocks_too(checkpoints):
    with streamed_model(checkpoints["llama"], resident_bytes=2**40) as model:
        blocks = repeated_block_list(model).blocks
        with torch.no_grad():
            model(input_ids=torch.arange(5, 15)[None])
        blocks[-1].register_forward_pre_hook(lambda module, args: 1 / 0)
        with pytest.raises(ZeroDivisionError), torch.no_grad():
            model(input_ids=torch.arange(5, 15)[None])
    assert all(param.is_meta for param in model.parameters())


def test_a_directory_without_a_block_list_is_named(tmp_path, save_checkpoint):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    save_checkpoint(transformers.GPT2LMHeadModel(config), tmp_path / "one")
    with pytest.raises(ValueError, match="no list of repeated blocks"):
        with streamed_model(tmp_path / "one"):
            pass
