"""A checkpoint in the layout transformers saves read under the model's own names
(``conversion/saving/checkpoint_layout.py``): Mixtral's and Qwen2-MoE's per-expert tensors joined
into the fused experts bit for bit; a mapping with an operation it does not read leaves its names."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")

from panther_lite.conversion.saving import checkpoint_layout  # noqa: E402
from panther_lite.conversion.saving.checkpoint_files import CheckpointFiles  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_per_expert_tensors_read_as_the_models_fused_experts(name, moe, tmp_path):
    model = moe.build(name)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    files = CheckpointFiles(tmp_path)
    assert any(".experts.0." in stored for stored in files.stored)  # the per-expert layout on disk
    state = {key: value for key, value in model.state_dict().items() if key in files.tensors}
    assert set(files.tensors) == set(state)
    read = files.read(list(state))
    for key, value in state.items():
        assert torch.equal(read[key], value), key


def test_a_mapping_with_an_operation_not_read_leaves_the_names(monkeypatch):
    class Transpose:  # an operation of transformers' the reader does not read
        pass

    mapping = checkpoint_layout._mapping("mixtral")
    converter = next(m for m in mapping if type(m).__name__ == "WeightConverter")
    monkeypatch.setattr(converter, "operations", [*converter.operations, Transpose()])
    monkeypatch.setattr(checkpoint_layout, "_mapping", lambda model_type: mapping)
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight" for e in range(2) for w in (1, 3)]
    sources = checkpoint_layout.model_sources("mixtral", names)
    assert sorted(sources) == sorted(n.replace(".block_sparse_moe.", ".mlp.") for n in names)
