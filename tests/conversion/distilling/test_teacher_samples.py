"""Sequences the original samples to distil on: continuations of the calibration samples' first tokens."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from panther_lite.conversion.distilling import (  # noqa: E402
    DistillConfig, sampled_batches, sampled_with_outputs, teacher_outputs, teacher_samples,
)
from panther_lite.conversion.distilling.objective import TopKLogProbs  # noqa: E402
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
    drawn = InverseTransformDraw(torch.Generator().manual_seed(0))(scores)
    assert drawn.shape == (40_000, 1)
    frequencies = torch.bincount(drawn[:, 0], minlength=6) / 40_000
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
    monkeypatch.setattr(teacher_samples, "_sampled", lambda teacher, prompts, length, seed, keep: (
        calls.append((prompts.shape[0], seed)), real(teacher, prompts, length, seed, keep))[1])
    batches = sampled_batches(lm, _calibration(), 5, 24, prefix=12, batch_size=2, seed=7, progress=False)
    assert calls == [(2, 7), (2, 8), (1, 9)]  # group i drawn with seed + i
    assert [b["input_ids"].shape for b in batches] == [(2, 24), (2, 24), (1, 24)]
    monkeypatch.setattr(teacher_samples, "KEY_VALUE_BYTES", 1)
    assert sampled_together(lm, 24) == 1  # a cache beyond the bound still samples, one at a time


def test_a_config_that_does_not_say_the_cache_shape_samples_the_default_number_together(lm, monkeypatch):
    monkeypatch.setattr(lm, "config", object())
    assert key_value_bytes(lm, 24) is None
    assert sampled_together(lm, 24) == teacher_samples.UNKNOWN_CACHE_TOGETHER


def test_the_end_of_text_is_never_drawn_however_likely(lm):
    favouring = copy.deepcopy(lm)
    favouring.generation_config.eos_token_id = [5, 9]
    with torch.no_grad():
        favouring.lm_head.weight[5] = favouring.model.norm.weight * 50  # token 5 first almost everywhere
    prompt = _calibration()[0]["input_ids"][:1, :12]
    assert favouring(prompt).logits[0, -1].argmax() == 5
    ids = sampled_batches(favouring, [{"input_ids": prompt.expand(64, 12)}], 64, 40, prefix=12, batch_size=64,
                          progress=False)[0]["input_ids"]
    assert not bool(torch.isin(ids[:, 12:], torch.tensor([5, 9])).any())


def _families():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    return {"gpt2": gpt2.eval(), "llama-grouped-heads": llama.eval()}


def _dense(kept: TopKLogProbs, vocabulary: int) -> torch.Tensor:
    """The kept log-probabilities written into (rows, vocabulary), the rest -inf (order-free)."""
    rows = torch.full((kept.log_probs.shape[0], vocabulary), -math.inf)
    return rows.scatter(1, kept.indices.long(), kept.log_probs)


@pytest.mark.parametrize("family", ["gpt2", "llama-grouped-heads"])
@pytest.mark.parametrize("top_k, temperature", [(64, 1.0), (8, 2.0)])
def test_outputs_kept_while_sampling_are_what_a_forward_over_the_sequences_caches(family, top_k, temperature):
    model = _families()[family]
    config = DistillConfig(top_k=top_k, temperature=temperature, progress=False)
    sampled, known = sampled_with_outputs(model, _calibration(), 5, 24, config, prefix=12, batch_size=2, seed=3)
    plain = sampled_batches(model, _calibration(), 5, 24, prefix=12, batch_size=2, seed=3, progress=False)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(sampled, plain))  # the same draw
    reference = teacher_outputs(model, sampled, config).targets
    assert len(known) == len(reference) == 3
    for got, want in zip(known, reference):
        assert got.log_probs.dtype == torch.float32 and got.indices.dtype == torch.int32
        assert got.log_probs.shape == want.log_probs.shape == (got.log_probs.shape[0], top_k)
        torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-4)  # sorted values: order-free
        if top_k == 64:
            assert got.tail is None
            torch.testing.assert_close(_dense(got, 64), _dense(want, 64), rtol=0, atol=1e-4)
        else:
            torch.testing.assert_close(got.tail, want.tail, rtol=0, atol=1e-4)


def test_known_outputs_are_cached_without_running_the_teacher_on_their_batches(lm):
    config = DistillConfig(top_k=8, progress=False)
    sampled, known = sampled_with_outputs(lm, _calibration(), 4, 20, config, prefix=12, batch_size=2)
    ran = []
    handle = lm.register_forward_hook(lambda module, args, kwargs_or_output: ran.append(1))
    try:
        cached = teacher_outputs(lm, _calibration() + sampled, config, known=[None] + known)
    finally:
        handle.remove()
    assert len(ran) == 1  # the calibration batch only
    assert cached.targets[1:] == tuple(known)
    assert cached.targets[0].log_probs.shape == (50, 8)  # the 20 + 10 + 20 real tokens of the calibration batch


def test_known_outputs_that_do_not_fit_their_batches_are_named(lm):
    config = DistillConfig(top_k=8, progress=False)
    sampled, known = sampled_with_outputs(lm, _calibration(), 2, 20, config, prefix=12, batch_size=2)
    data = _calibration() + sampled
    cases = [([None], ValueError, "known holds 1 targets for 2 data batches"),
             ([None, known[0].log_probs], ValueError, r"known\[1\] must be the TopKLogProbs of the 40 real tokens"),
             ([known[0], None], ValueError, r"known\[0\] must be the TopKLogProbs of the 50 real tokens")]
    for given, error, match in cases:
        with pytest.raises(error, match=match):
            teacher_outputs(lm, data, config, known=given)
    with pytest.raises(ValueError, match=r"known\[0\] is given, but data batch 0 is not a dict with input_ids"):
        teacher_outputs(lm, [data[0]["input_ids"], data[1]], config, known=known * 2)
    with pytest.raises(ValueError, match=r"known\[1\] keeps the top 8 log-probabilities of logits, but .*top_k=16"):
        teacher_outputs(lm, data, config, known=[None, *known], top_k=16)
    with pytest.raises(ValueError, match=r"known\[1\] keeps the top 8 .* loss='mse'"):
        teacher_outputs(lm, data, config, known=[None, *known], loss="mse")


def test_sampling_with_outputs_needs_settings_that_compare_logits(lm):
    for config, match in [(DistillConfig(loss="mse"), "outputs=None, loss='mse'"),
                          (DistillConfig(outputs="hidden_states"), "outputs='hidden_states', loss='auto'")]:
        with pytest.raises(ValueError, match=f"config must compare logits .*got {match}"):
            sampled_with_outputs(lm, _calibration(), 2, 20, config, prefix=12)
    with pytest.raises(TypeError, match="config must be a DistillConfig, got dict"):
        sampled_with_outputs(lm, _calibration(), 2, 20, {"top_k": 8}, prefix=12)
