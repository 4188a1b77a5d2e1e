"""A checkpoint streamed for evaluation holds one block in memory at a time, and none after."""
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


def test_a_forward_that_fails_inside_a_block_releases_it(checkpoints):
    with streamed_model(checkpoints["llama"]) as model:
        blocks = repeated_block_list(model).blocks

        def fail(module, args):
            raise RuntimeError("boom")

        blocks[1].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            model(input_ids=torch.arange(5, 15)[None])
    assert all(param.is_meta for param in model.parameters())


def test_a_directory_without_a_block_list_is_named(tmp_path, save_checkpoint):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    save_checkpoint(transformers.GPT2LMHeadModel(config), tmp_path / "one")
    with pytest.raises(ValueError, match="no list of repeated blocks"):
        with streamed_model(tmp_path / "one"):
            pass
