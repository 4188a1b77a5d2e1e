"""The head replay of the out-of-core pipeline: the model run from its last block's output gives
the model's output (blocks returning tensors or tuples); the blocks' gains to the output from a
backward pass streamed block by block in reverse equal the whole model's backward; the sharded
output's parts become transformers shards with their index."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from panther_lite.conversion.calibration.batches import run_batch  # noqa: E402
from panther_lite.conversion.pipelines.blocks import (  # noqa: E402
    BlockList, BlockRunner, find_blocks, hidden_states, run_block, with_hidden,
)
from panther_lite.conversion.pipelines.capture import capture_calls  # noqa: E402
from panther_lite.conversion.pipelines.head_replay import (  # noqa: E402
    HeadRunner, output_template, streamed_block_gains,
)
from panther_lite.conversion.planning.sensitivity import block_output_gains  # noqa: E402
from panther_lite.conversion.saving.shards import finalize_shards, write_part  # noqa: E402
from panther_lite.conversion.selection import select_layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class TupleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, hidden, scale):
        return hidden + scale * torch.tanh(self.mix(hidden)), None


class TupleStack(nn.Module):
    """Blocks returning ``(hidden, None)`` and a head after a norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers = nn.Embedding(20, 8), nn.ModuleList(TupleBlock() for _ in range(3))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.layers:
            hidden = block(hidden, 0.5)[0]
        return self.head(self.norm(hidden))


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config).double().eval()


def _calls(model, block_list: BlockList, batch) -> list:
    """Each block's own call on ``batch`` (h27's capture; later blocks' hidden states None)."""
    records = select_layers(model, None, None, None)
    captured = capture_calls(model, block_list, records, [batch], sequential=False, cache_device=torch.device("cpu"),
                             materialise=lambda index, block: contextlib.nullcontext())
    return captured.calls[0]


def _outputs(model, block_list: BlockList, calls) -> list:
    """Each block's output on the batch whose block calls are ``calls``, block by block."""
    hidden, outputs = hidden_states(calls[0]), []
    for block, call in zip(block_list.blocks, calls):
        (hidden,) = run_block(BlockRunner(model, block, None), [with_hidden(call, hidden)], None, "block")
        outputs.append(hidden)
    return outputs


@pytest.mark.parametrize("build,batch", [
    (_llama, {"input_ids": torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1))}),
    (lambda: TupleStack().double(), (torch.randint(0, 20, (3, 4), generator=torch.Generator().manual_seed(2)),)),
])
def test_the_head_replayed_on_the_last_blocks_output_gives_the_models_output(build, batch):
    model = build()
    block_list, _ = find_blocks(model, select_layers(model, None, None, None), "auto")
    calls = _calls(model, block_list, batch)
    head = HeadRunner(model, block_list, output_template(block_list.blocks[0], calls[0]))
    with torch.no_grad():
        expected = run_batch(model, batch)
        got = head(batch, _outputs(model, block_list, calls)[-1])
    expected = getattr(expected, "logits", expected)
    torch.testing.assert_close(getattr(got, "logits", got), expected, rtol=1e-12, atol=1e-12)
    assert all(isinstance(block, type(block_list.blocks[0])) for block in model.get_submodule(block_list.path))


@pytest.mark.parametrize("metric", ["kl", "norm"])
@pytest.mark.parametrize("count", [3, 2])
def test_streamed_block_gains_equal_the_whole_models_backward(count, metric):
    model, batch = _llama(), {"input_ids": torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1)),
                              "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}
    block_list, _ = find_blocks(model, select_layers(model, None, None, None), "auto")
    calls = _calls(model, block_list, batch)
    expected = block_output_gains(model, block_list.blocks[:count], lambda m: run_batch(m, batch), metric)
    head = HeadRunner(model, block_list, output_template(block_list.blocks[0], calls[0]))
    outputs = _outputs(model, block_list, calls)
    got = streamed_block_gains(head, block_list, count, batch, calls, outputs.__getitem__,
                               lambda index: contextlib.nullcontext(), metric=metric)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-9, atol=0)
    assert len(set(got)) == count  # not the 1.0 fallback


def test_parts_become_shards_with_their_index_even_after_an_interrupted_move(tmp_path):
    parts = []
    for index in range(3):
        parts.append(tmp_path / f"part-{index}.safetensors")
        write_part(parts[-1], {f"layer{index}.weight": torch.full((2, index + 1), float(index))})
    (tmp_path / "out").mkdir()
    parts[0].rename(tmp_path / "out" / "model-00001-of-00003.safetensors")  # a move a killed run finished
    index = json.loads(finalize_shards(parts, tmp_path / "out").read_text())
    assert index["weight_map"] == {f"layer{i}.weight": f"model-0000{i + 1}-of-00003.safetensors" for i in range(3)}
    assert index["metadata"]["total_size"] == 4 * 2 * (1 + 2 + 3)  # float32 bytes
    assert not any(tmp_path.glob("part-*")) and not any(tmp_path.rglob("*.tmp"))
