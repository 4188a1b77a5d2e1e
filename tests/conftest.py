"""Shared test configuration: the ``cuda`` marker (skips cleanly without a CUDA device)
and fixtures several test packages use (tiny transformers checkpoints on disk for the
command's tests among them)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny fits: on a machine busier than its cores,
    OpenMP's spinning makes each tiny LAPACK call take up to a second with two threads (well
    under 1 ms with one). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def logits_error():
    """``error(model, reference, batches)``: relative Frobenius error of ``model``'s logits
    against ``reference``'s over ``model(**batch)`` calls."""

    def error(model, reference, batches) -> float:
        with torch.no_grad():
            squared = sum(float((model(**b).logits - reference(**b).logits).square().sum()) for b in batches)
            return (squared / sum(float(reference(**b).logits.square().sum()) for b in batches)) ** 0.5

    return error


@pytest.fixture
def repo_root() -> Path:
    """The checkout's root directory (scripts, tutorials and docs live under it)."""
    return ROOT


COMMAND_WORDS = "the a cat dog sat ran on under mat log red blue big small quick slow fox jumps over lazy".split()
_COMMAND_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_HIDDEN, _FFN, _HEADS, _POSITIONS = 32, 64, 4, 32


def _word_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(_COMMAND_SPECIAL + COMMAND_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _tiny_models() -> dict:
    """``{name: builder}`` of random-init GPT-2, LLaMA and BERT models over the word vocabulary."""
    import transformers

    vocab = len(_COMMAND_SPECIAL) + len(COMMAND_WORDS)
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=_HIDDEN, n_layer=2, n_head=_HEADS, n_positions=_POSITIONS)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=2,
            num_attention_heads=_HEADS, num_key_value_heads=2, max_position_embeddings=_POSITIONS)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=vocab, hidden_size=_HIDDEN, num_hidden_layers=2, num_attention_heads=_HEADS,
            intermediate_size=_FFN, max_position_embeddings=_POSITIONS)),
    }  # fmt: skip


@pytest.fixture(scope="session")
def word_tokenizer():
    """A callable building the word-level tokenizer of the tiny checkpoints (a new one per call)."""
    return _word_tokenizer


@pytest.fixture(scope="session")
def save_checkpoint():
    """``save(model, directory) -> directory``: the model and the word tokenizer saved there."""

    def save(model, directory: Path) -> Path:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # its bars would land in the next test's stderr
        try:
            model.save_pretrained(str(directory))
        finally:
            transformers_logging.enable_progress_bar()
        _word_tokenizer().save_pretrained(str(directory))
        return directory

    return save


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, save_checkpoint) -> dict:
    """``{name: directory}`` of tiny random-init models saved with a tokenizer (shared: tests that
    write near a checkpoint copy it first)."""
    root = tmp_path_factory.mktemp("checkpoints")
    saved = {}
    for name, build in _tiny_models().items():
        torch.manual_seed(0)
        saved[name] = save_checkpoint(build().eval(), root / name)
    return saved


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A calibration text file of short word sequences, with blank lines the command skips."""
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(24):
        picks = torch.randint(len(COMMAND_WORDS), (4 + i % 9,), generator=generator)
        lines.append(" ".join(COMMAND_WORDS[j] for j in picks))
        if i % 5 == 0:
            lines.append("   ")
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
