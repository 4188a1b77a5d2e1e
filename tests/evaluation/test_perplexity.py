"""panther_lite.perplexity: the standard protocol against a plain PyTorch reference, padding,
streamed against in memory, and every bad input ending in a clear error."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import panther_lite
from panther_lite.evaluation.perplexity import DEFAULT_MAX_SEQ_LEN

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = " ".join(["the quick red fox jumps over the lazy dog and the big cat sat on the mat"] * 12)


@pytest.fixture(scope="module")
def llama(checkpoints):
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])).eval()


def reference_perplexity(model, ids: torch.Tensor, seq_len: int) -> float:
    """exp of the mean of transformers' own next-token loss over non-overlapping windows."""
    windows = ids[: ids.numel() // seq_len * seq_len].reshape(-1, seq_len)
    with torch.no_grad():
        losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    return math.exp(sum(losses) / len(losses))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_equals_the_mean_next_token_loss_over_non_overlapping_windows(name, checkpoints, word_tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints[name])).eval()
    tokenizer = word_tokenizer()
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    value = panther_lite.perplexity(model, TEXT, tokenizer=tokenizer, seq_len=16, progress=False)
    assert float(value) == pytest.approx(reference_perplexity(model, ids, 16), rel=1e-6)
    assert (value.windows, value.seq_len, value.tokens) == (ids.numel() // 16, 16, ids.numel() // 16 * 15)
    assert value.nll == pytest.approx(math.log(value), rel=1e-12)


@settings(max_examples=12, deadline=None)
@given(seq_len=st.integers(2, 32), batch_size=st.integers(1, 9))
def test_the_batch_size_never_changes_the_result(llama, word_tokenizer, seq_len, batch_size):
    tokenizer = word_tokenizer()
    one = panther_lite.perplexity(llama, TEXT, tokenizer=tokenizer, seq_len=seq_len, batch_size=1, progress=False)
    many = panther_lite.perplexity(llama, TEXT, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size,
                                   progress=False)
    assert float(many) == pytest.approx(float(one), rel=1e-5)
    assert many.tokens == one.tokens


def test_padding_is_never_predicted_nor_counted(llama):
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 25, (n,), generator=generator) for n in (12, 7, 9)]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : row.numel()], mask[i, : row.numel()] = row, 1
    padded = panther_lite.perplexity(llama, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    nll = [math.log(panther_lite.perplexity(llama, row[None], progress=False)) * (row.numel() - 1) for row in rows]
    assert padded.tokens == sum(row.numel() - 1 for row in rows)
    assert float(padded) == pytest.approx(math.exp(sum(nll) / padded.tokens), rel=1e-5)


def test_a_text_file_and_a_list_of_documents_are_text(llama, word_tokenizer, tmp_path):
    tokenizer = word_tokenizer()
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    from_file = panther_lite.perplexity(llama, path, tokenizer=tokenizer, seq_len=16, progress=False)
    assert float(from_file) == float(panther_lite.perplexity(llama, TEXT, tokenizer=tokenizer, seq_len=16, progress=False))
    documents = panther_lite.perplexity(llama, [TEXT[:200], TEXT[200:]], tokenizer=tokenizer, seq_len=16, progress=False)
    joined = panther_lite.perplexity(llama, TEXT[:200] + "\n\n" + TEXT[200:], tokenizer=tokenizer, seq_len=16,
                                     progress=False)
    assert float(documents) == float(joined)


def test_the_default_window_is_the_models_positions_at_most_the_protocols_cap(llama, word_tokenizer):
    value = panther_lite.perplexity(llama, TEXT, tokenizer=word_tokenizer(), progress=False)
    assert value.seq_len == min(llama.config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)


def test_a_checkpoint_directory_is_streamed_and_gives_the_in_memory_result(checkpoints, llama, word_tokenizer):
    in_memory = panther_lite.perplexity(llama, TEXT, tokenizer=word_tokenizer(), seq_len=16, progress=False)
    streamed = panther_lite.perplexity(checkpoints["llama"], TEXT, seq_len=16, progress=False)
    assert float(streamed) == float(in_memory)


def test_a_saved_compressed_model_streams_with_its_sketched_layers(checkpoints, word_tokenizer, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])).eval()
    panther_lite.convert(model, param_ratio=0.4, seed=0, progress=False)
    panther_lite.save_pretrained(model, tmp_path / "out")
    word_tokenizer().save_pretrained(str(tmp_path / "out"))
    in_memory = panther_lite.perplexity(model, TEXT, tokenizer=word_tokenizer(), seq_len=16, progress=False)
    assert float(panther_lite.perplexity(tmp_path / "out", TEXT, seq_len=16, progress=False)) == float(in_memory)


def _nan_model(checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"])).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    return model


class _NoHead(nn.Module):
    def forward(self, ids):
        return ids.float()


@pytest.mark.parametrize("case, match", [
    ("empty text", "the text is empty"),
    ("short text", "fewer than one window of seq_len=16"),
    ("path as str", "pass it as pathlib.Path"),
    ("seq_len beyond positions", "beyond the model's 32 positions"),
    ("seq_len 1", "at least 2"),
    ("no lm head", "is not a causal language model"),
    ("masked lm", "is not a causal language model"),
    ("plain module without logits", "has no language-model head"),
    ("big tokenizer", "is not this model's tokenizer"),
    ("ids past the vocabulary", "outside the model's vocabulary"),
    ("nan logits", "NaN or infinite in window 0"),
    ("text without tokenizer", "pass tokenizer="),
    ("float ids", "integer tensor of token ids"),
    ("bad data type", "data must be text"),
    ("bad batch size", "batch_size"),
])  # fmt: skip
def test_bad_input_is_a_clear_error_and_changes_nothing(case, match, checkpoints, word_tokenizer, llama):
    tokenizer = word_tokenizer()
    big = transformers.AutoTokenizer.from_pretrained(str(checkpoints["llama"]))
    big.add_tokens([f"extra{i}" for i in range(40)])
    model, kwargs, data = llama, dict(tokenizer=tokenizer, seq_len=16), TEXT
    if case == "empty text":
        data = "   "
    elif case in ("short text", "path as str"):
        data = "the cat" if case == "short text" else "notes.txt"
    elif case == "seq_len beyond positions":
        kwargs["seq_len"] = 33
    elif case == "seq_len 1":
        kwargs["seq_len"] = 1
    elif case == "no lm head":
        model = transformers.AutoModel.from_pretrained(str(checkpoints["llama"]))
    elif case == "masked lm":
        model = transformers.AutoModelForMaskedLM.from_pretrained(str(checkpoints["bert"]))
    elif case == "plain module without logits":
        model, kwargs, data = _NoHead(), {}, torch.arange(20)[None]
    elif case == "big tokenizer":
        kwargs["tokenizer"] = big
    elif case == "ids past the vocabulary":
        kwargs, data = {}, torch.full((1, 8), 500)
    elif case == "nan logits":
        model = _nan_model(checkpoints)
    elif case == "text without tokenizer":
        kwargs = {}
    elif case == "float ids":
        kwargs, data = {}, torch.rand(1, 8)
    elif case == "bad data type":
        kwargs, data = {}, 3.5
    elif case == "bad batch size":
        kwargs["batch_size"] = 0
    model.train()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises((ValueError, TypeError), match=match):
        panther_lite.perplexity(model, data, progress=False, **kwargs)
    assert model.training
    model.eval()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0, equal_nan=True)


def test_a_model_that_is_neither_a_module_nor_a_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an nn.Module nor a directory"):
        panther_lite.perplexity(tmp_path / "missing", TEXT)
    with pytest.raises(TypeError, match="model must be an nn.Module or a checkpoint directory"):
        panther_lite.perplexity(42, TEXT)
