"""save_pretrained / from_pretrained: a converted model comes back with identical outputs
(plain modules through a factory, sentence-transformers through its class), is built without
initialising its weights, and bad directories fail with clear errors and leave nothing
half-written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("safetensors")

import panther_lite  # noqa: E402
from panther_lite.conversion.saving.loading import from_pretrained  # noqa: E402
from panther_lite.conversion.saving.pretrained import PRETRAINED_CONFIG_NAME, save_pretrained  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402


class TiedNet(nn.Module):
    """Embedding, MLP and a head tied to the embedding: (batch, seq) ids -> (batch, seq, vocab)."""

    def __init__(self, width: int = 32, vocab: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 64)
        self.down = nn.Linear(64, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        # computed in __init__ and not saved: must keep its value through loading
        self.register_buffer("offset", torch.linspace(0, 1, width), persistent=False)
        self.built_on_meta = self.up.weight.is_meta

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids) + self.offset
        return self.head(self.down(torch.relu(self.up(hidden))))


@pytest.fixture
def converted() -> TiedNet:
    torch.manual_seed(0)
    model = TiedNet()
    panther_lite.convert(model, target_modules=["up", "down"], num_terms=1, low_rank=4)
    return model


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))


def test_round_trip_is_exact(converted, ids, tmp_path):
    save_pretrained(converted, tmp_path / "model")
    loaded = from_pretrained(TiedNet, tmp_path / "model")
    assert isinstance(loaded.up, SKLinear) and isinstance(loaded.down, SKLinear)
    assert torch.equal(loaded(ids), converted(ids))
    assert loaded.head.weight is loaded.embed.weight  # the tie survives
    assert [n for n, p in loaded.named_parameters() if p.requires_grad] == [
        n for n, p in converted.named_parameters() if p.requires_grad
    ]


def test_factory_runs_with_parameters_on_meta(converted, tmp_path):
    save_pretrained(converted, tmp_path)
    loaded = from_pretrained(lambda width: TiedNet(width=width), tmp_path, width=32)
    assert loaded.built_on_meta  # nothing was initialised only to be overwritten
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])


def test_dense_model_round_trips(ids, tmp_path):
    model = TiedNet()
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / PRETRAINED_CONFIG_NAME).read_text())["conversion"]["layers"] == []
    assert torch.equal(from_pretrained(TiedNet, tmp_path)(ids), model(ids))


def test_save_keeps_other_files_and_replaces_its_own(converted, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    save_pretrained(TiedNet(), tmp_path)
    save_pretrained(converted, tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert isinstance(from_pretrained(TiedNet, tmp_path).up, SKLinear)
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")) == []


def test_failed_save_changes_nothing(converted, tmp_path, monkeypatch):
    import safetensors.torch

    save_pretrained(TiedNet(), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def write_half_then_fail(model, filename, **kwargs):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_model", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(converted, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert [p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")] == []


def _rewrite_record(directory: Path, **changes) -> None:
    path = directory / PRETRAINED_CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda d: (d / PRETRAINED_CONFIG_NAME).unlink(), FileNotFoundError, "not saved by panther_lite"),
        (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "model.safetensors"),
        (lambda d: _rewrite_record(d, version=99), ValueError, "version 99"),
        (lambda d: _rewrite_record(d, format="other"), ValueError, "not a panther_lite save"),
        (lambda d: (d / PRETRAINED_CONFIG_NAME).write_text("{"), ValueError, "not valid JSON"),
    ],
    ids=["no-config", "no-weights", "other-version", "other-format", "bad-json"],
)
def test_damaged_directory_is_a_clear_error(converted, tmp_path, damage, error, message):
    save_pretrained(converted, tmp_path)
    damage(tmp_path)
    with pytest.raises(error, match=message):
        from_pretrained(TiedNet, tmp_path)


def test_bad_arguments_are_clear_errors(converted, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(TiedNet, tmp_path / "absent")
    with pytest.raises(TypeError, match="nn.Module"):
        save_pretrained("model", tmp_path)
    with pytest.raises(TypeError, match="directory"):
        save_pretrained(converted, 3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        save_pretrained(converted, tmp_path / "file")
    save_pretrained(converted, tmp_path / "saved")
    with pytest.raises(TypeError, match="nn.Module"):
        from_pretrained(lambda: "not a model", tmp_path / "saved")
    with pytest.raises(ValueError, match="does not hold|does not exist|expects"):
        from_pretrained(lambda: TiedNet(width=16), tmp_path / "saved")


def _tiny_sentence_transformer(directory: Path):
    """A random-init 1-layer BERT with a 40-word vocabulary, mean pooling."""
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("sentence_transformers")
    directory.mkdir()
    words = "the a cat dog sat ran on mat park fast slow red blue big small".split()
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(directory)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(directory)
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer
    encoder = Transformer(str(directory), max_seq_length=16)
    return st.SentenceTransformer(modules=[encoder, Pooling(32)], device="cpu")


def test_sentence_transformer_round_trip(tmp_path):
    model = _tiny_sentence_transformer(tmp_path / "base")
    sentences = ["the cat sat on the mat", "a big dog ran fast in the park"]
    report = panther_lite.convert(model, target_modules=r".*(intermediate|output)\.dense", num_terms=1, low_rank=2)
    assert set(report["status"]) == {"converted"}
    expected = model.encode(sentences, convert_to_tensor=True)
    save_pretrained(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]["quant_method"] == "panther_lite"
    loaded = from_pretrained(type(model), tmp_path / "saved", device="cpu")
    assert sum(isinstance(m, SKLinear) for m in loaded.modules()) == len(report)
    assert torch.equal(loaded.encode(sentences, convert_to_tensor=True), expected)
    with pytest.raises(TypeError, match="sentence-transformers"):
        from_pretrained(TiedNet, tmp_path / "saved")


def test_sentence_transformer_layers_outside_its_transformer_are_refused(tmp_path):
    model = _tiny_sentence_transformer(tmp_path / "base")
    model.append(nn.Sequential(nn.Linear(32, 32)))
    panther_lite.convert(model, target_modules=["2.0"], num_terms=1, low_rank=2)
    with pytest.raises(ValueError, match="outside the transformers model"):
        save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
