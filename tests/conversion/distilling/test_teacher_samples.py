"""Sequences the original samples to distil on: continuations of the calibration samples' first tokens."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from panther_lite.conversion.distilling import sampled_batches, teacher_samples  # noqa: E402
from panther_lite.conversion.distilling.teacher_samples import (  # noqa: E402
    InverseTransformDraw, key_value_bytes, sampled_together,
)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _calibration():
    ids = torch.randint(64, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # a short sample, right-padded: too short for a prefix of 12
    return [{"input_ids": ids, "attention_mask": mask}]


def test_each_sequence_continues_a_long_enough_calibration_sample_in_turn(lm):
    batches = sampled_batches(lm, _calibration(), 5, 24, prefix=12, batch_size=2, progress=False)
    assert [b["input_ids"].shape for b in batches] == [(2, 24), (2, 24), (1, 24)]
    assert all(bool(b["attention_mask"].all()) for b in batches)
    ids = torch.cat([b["input_ids"] for b in batches])
    calibration = _calibration()[0]["input_ids"]
    for row, source in zip(ids, [0, 2, 0, 2, 0]):  # sample 1 holds 10 real tokens: skipped
        assert torch.equal(row[:12], calibration[source, :12])
    assert not torch.equal(ids[0, 12:], ids[2, 12:])  # sampled, not greedy: the same prompt goes on differently


def test_a_seed_repeats_the_draw_and_leaves_the_global_generator_alone(lm):
    state = torch.random.get_rng_state()
    first = sampled_batches(lm, _calibration(), 3, 20, prefix=12, seed=4, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = sampled_batches(lm, _calibration(), 3, 20, prefix=12, seed=4, progress=False)
    other = sampled_batches(lm, _calibration(), 3, 20, prefix=12, seed=5, progress=False)
    assert torch.equal(first[0]["input_ids"], again[0]["input_ids"])
    assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])


def test_the_draw_follows_the_softmax_and_never_takes_an_impossible_token():
    scores = torch.tensor([2.0, 0.0, -math.inf, 1.0, -1.0, 0.5]).expand(40_000, 6)
    drawn = InverseTransformDraw(torch.Generator().manual_seed(0))(None, scores)
    assert torch.equal(drawn.isfinite().sum(dim=1), torch.ones(40_000, dtype=torch.long))
    frequencies = torch.bincount(drawn.argmax(dim=1), minlength=6) / 40_000
    probabilities = torch.softmax(scores[0], dim=0)
    assert frequencies[2] == 0
    torch.testing.assert_close(frequencies, probabilities, rtol=0, atol=0.01)  # 4 standard errors of the largest


def test_the_sampled_first_tokens_follow_the_teachers_distribution(lm):
    peaked = copy.deepcopy(lm)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(40)  # far from uniform: a wrong temperature or a uniform draw shows
        prompt = _calibration()[0]["input_ids"][:1, :12]
        probabilities = torch.softmax(peaked(prompt).logits[0, -1], dim=0)
    assert 0.2 < float(probabilities.max()) < 0.9
    rows = 8_000
    batches = sampled_batches(peaked, [{"input_ids": prompt.expand(rows, 12)}], rows, 13, prefix=12, batch_size=rows,
                              progress=False)
    frequencies = torch.bincount(batches[0]["input_ids"][:, 12], minlength=64) / rows
    torch.testing.assert_close(frequencies, probabilities, rtol=0, atol=0.025)  # 4.5 standard errors at p = 0.5


@pytest.mark.parametrize("options, error, match", [
    ({"count": 0}, ValueError, "count"),
    ({"length": 12}, ValueError, "length must be an integer >= 13"),
    ({"prefix": 21, "length": 30}, ValueError, "no calibration sample holds prefix=21 tokens"),
    ({"batch_size": 0}, ValueError, "batch_size"),
])
def test_bad_arguments_are_named(lm, options, error, match):
    arguments = {"count": 2, "length": 16, "prefix": 12, **options}
    with pytest.raises(error, match=match):
        sampled_batches(lm, _calibration(), progress=False, **arguments)


def test_a_model_without_generate_is_refused():
    with pytest.raises(TypeError, match="teacher must be a causal LM with generate"):
        sampled_batches(torch.nn.Linear(2, 2), _calibration(), 2, 16, progress=False)


def _cache_bytes(model, length):
    """Bytes of the key/value cache transformers itself holds after a forward over ``length`` tokens."""
    with torch.no_grad():
        cache = model(torch.zeros(1, length, dtype=torch.long), use_cache=True).past_key_values
    tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@pytest.mark.parametrize("family, dtype", [("llama-grouped-heads", torch.float32), ("llama-grouped-heads", torch.bfloat16),
                                           ("gpt2", torch.float32)])
def test_the_key_value_bytes_are_the_cache_transformers_holds(family, dtype):
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4))
    else:  # two key/value heads for six query heads, each 16 wide (not hidden_size / heads)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16))
    model = model.to(dtype).eval()
    assert key_value_bytes(model, 20) == _cache_bytes(model, 20)


def test_sequences_are_sampled_as_many_together_as_the_cache_bound_allows(lm, monkeypatch):
    assert sampled_together(lm, 24) == teacher_samples.MOST_TOGETHER  # a tiny cache
    monkeypatch.setattr(teacher_samples, "KEY_VALUE_BYTES", int(2.5 * key_value_bytes(lm, 24)))
    assert sampled_together(lm, 24) == 2
    calls, real = [], teacher_samples._sampled
    monkeypatch.setattr(teacher_samples, "_sampled", lambda teacher, prompts, length, seed: (
        calls.append((prompts.shape[0], seed)), real(teacher, prompts, length, seed))[1])
    batches = sampled_batches(lm, _calibration(), 5, 24, prefix=12, batch_size=2, seed=7, progress=False)
    assert calls == [(2, 7), (2, 8), (1, 9)]  # group i drawn with seed + i
    assert [b["input_ids"].shape for b in batches] == [(2, 24), (2, 24), (1, 24)]
    monkeypatch.setattr(teacher_samples, "KEY_VALUE_BYTES", 1)
    assert sampled_together(lm, 24) == 1  # a cache beyond the bound still samples, one at a time


def test_a_config_that_does_not_say_the_cache_shape_samples_the_default_number_together(lm, monkeypatch):
    monkeypatch.setattr(lm, "config", object())
    assert key_value_bytes(lm, 24) is None
    assert sampled_together(lm, 24) == teacher_samples.UNKNOWN_CACHE_TOGETHER
