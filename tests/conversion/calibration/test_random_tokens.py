"""Random-token calibration batches (panther_lite.random_token_batches): the tokenizer's
ordinary vocabulary only, wrapped like one text, reproducible, validated, and a prior that
keeps a calibrated conversion's quality on tokens the calibration text never used."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import panther_lite  # noqa: E402
from panther_lite.conversion.calibration.random_tokens import ordinary_token_ids  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]", "<extra_id_0>"]
WORDS = [f"w{i}" for i in range(200)]
pytestmark = pytest.mark.usefixtures("one_thread")


def _tokenizer(wrapped: bool = True):
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if wrapped:
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )


def test_ordinary_ids_leave_out_special_and_reserved_tokens():
    ids = ordinary_token_ids(_tokenizer())
    assert ids.tolist() == list(range(len(SPECIAL), len(SPECIAL) + len(WORDS)))


def test_batches_wrap_each_row_like_one_text_and_cover_the_vocabulary():
    tokenizer = _tokenizer()
    batches = panther_lite.random_token_batches(tokenizer, 400, 12, batch_size=160)
    assert [b["input_ids"].shape for b in batches] == [(160, 14), (160, 14), (80, 14)]
    ids = torch.cat([b["input_ids"] for b in batches])
    assert (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()
    assert set(ids[:, 1:-1].unique().tolist()) == set(ordinary_token_ids(tokenizer).tolist())
    assert all(torch.equal(b["attention_mask"], torch.ones_like(b["input_ids"])) for b in batches)


def test_an_unwrapping_tokenizer_gets_bare_rows_and_seeds_reproduce():
    tokenizer = _tokenizer(wrapped=False)
    first = panther_lite.random_token_batches(tokenizer, 5, 7, seed=3)
    assert first[0]["input_ids"].shape == (5, 7)
    assert torch.equal(first[0]["input_ids"], panther_lite.random_token_batches(tokenizer, 5, 7, seed=3)[0]["input_ids"])
    assert not torch.equal(first[0]["input_ids"], panther_lite.random_token_batches(tokenizer, 5, 7, seed=4)[0]["input_ids"])


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((0,), {}, ValueError, "count"),
        ((4, 0), {}, ValueError, "length"),
        ((4,), {"batch_size": -1}, ValueError, "batch_size"),
        ((4,), {"seed": 1.5}, ValueError, "seed"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        panther_lite.random_token_batches(_tokenizer(), *args, **kwargs)


def test_a_non_tokenizer_is_refused():
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer"):
        panther_lite.random_token_batches("bert-base-uncased", 4)


def test_random_tokens_keep_quality_on_words_the_calibration_text_never_used(logits_error):
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    config = transformers.BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32,
    )
    model = transformers.BertForMaskedLM(config).double().eval()
    generator = torch.Generator().manual_seed(1)

    def text_batches(words, count):
        lines = [" ".join(words[j] for j in torch.randint(len(words), (10,), generator=generator)) for _ in range(count)]
        return [dict(tokenizer(lines[i : i + 8], return_tensors="pt")) for i in range(0, count, 8)]

    calibration, unseen = text_batches(WORDS[:5], 32), text_batches(WORDS[100:], 16)
    options = dict(target_modules="all-linear", exclude_modules=["cls.predictions.decoder"], param_ratio=0.4,
                   progress=False)
    text_only, with_prior = copy.deepcopy(model), copy.deepcopy(model)
    panther_lite.convert(text_only, calibration_data=calibration, **options)
    prior = panther_lite.random_token_batches(tokenizer, 64, 10, batch_size=8)
    panther_lite.convert(with_prior, calibration_data=calibration + prior, **options)
    assert logits_error(with_prior, model, unseen) < 0.95 * logits_error(text_only, model, unseen)


def _gapped_tokenizer():
    """Ids 0-4 special, 5-14 words, 15-24 unused, 25-34 words: ``len(tokenizer)`` is 25 and the
    last id 34."""
    vocab = {token: i for i, token in enumerate(SPECIAL[:5])}
    vocab.update({word: 5 + i + (10 if i >= 10 else 0) for i, word in enumerate(WORDS[:20])})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )


def test_a_vocabulary_with_gaps_draws_every_real_token_and_nothing_else():
    tokenizer = _gapped_tokenizer()
    real = set(range(5, 15)) | set(range(25, 35))
    assert len(tokenizer) == 25 and set(ordinary_token_ids(tokenizer).tolist()) == real
    ids = torch.cat([batch["input_ids"] for batch in panther_lite.random_token_batches(tokenizer, 200, 10)])
    assert set(ids.unique().tolist()) == real  # 2,000 draws from 20 tokens: each is drawn (p of a miss < 1e-40)


def test_a_count_beyond_memory_is_named_before_anything_is_allocated(monkeypatch):
    tokenizer = _tokenizer()
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: pytest.fail("allocated before checking"))
    with pytest.raises(ValueError, match=r"count=1,000,000,000,000: .* GiB .* more than this machine's"):
        panther_lite.random_token_batches(tokenizer, 10**12)


def test_rows_longer_than_the_models_positions_name_length():
    tokenizer = _tokenizer()
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=20,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"length=19: .* longer than the 20 of the model's positions .* length <= 18"):
        panther_lite.random_token_batches(tokenizer, 4, 19, model=model)
    rows = panther_lite.random_token_batches(tokenizer, 4, 18, model=model)[0]
    assert rows["input_ids"].shape == (4, 20)
    with torch.no_grad():
        model(**rows)  # the longest accepted rows run
    tokenizer.model_max_length = 12  # without a model, the tokenizer's limit
    with pytest.raises(ValueError, match=r"length=11: .* tokenizer's model_max_length; pass length <= 10"):
        panther_lite.random_token_batches(tokenizer, 4, 11)
