"""The key/value cache the sampling loop decodes with (key_value_cache.preallocated_cache): each
layer's keys and values are exactly what the plain cache concatenates, written into buffers
allocated once (grown when outgrown), layers of other kinds left as the model makes them, and the
model's logits the same as with its own cache."""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from panther_lite.conversion.distilling import teacher_samples  # noqa: E402
from panther_lite.conversion.distilling.key_value_cache import preallocated_cache  # noqa: E402


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("capacity", [9, 3])  # room for all, and outgrown twice
def test_a_layer_holds_what_the_plain_cache_concatenates_in_buffers_allocated_once(capacity):
    layer = preallocated_cache(_llama(), capacity).layers[0]
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 3, tokens, 5, generator=generator) for tokens in (4, 1, 1, 1, 1, 1)]
    pointers = set()
    for index in range(len(steps)):
        keys, values = layer.update(steps[index], 2 * steps[index])
        expected = torch.cat(steps[:index + 1], dim=-2)
        assert torch.equal(keys, expected) and torch.equal(values, 2 * expected)
        assert keys.data_ptr() == layer.buffers[0].data_ptr()  # a view, not a copy
        pointers.add(layer.buffers[0].data_ptr())
    assert layer.get_seq_length() == 9
    assert len(pointers) == (1 if capacity == 9 else 3)


@pytest.mark.parametrize("make", [_llama, _gpt2])
def test_decoding_with_it_gives_the_logits_of_the_models_own_cache(make):
    model = make()
    keyword = teacher_samples._cache_keyword(model)
    ids = torch.randint(64, (3, 6), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, past in [("own", None), ("preallocated", preallocated_cache(model, 12))]:
        step, found = ids, []
        for _ in range(5):
            out, past = teacher_samples._next_logits(model, step, past, keyword)
            found.append(out)
            step = out[:, -1:].argmax(-1)
        logits[name] = torch.cat(found, dim=1)
    torch.testing.assert_close(logits["preallocated"], logits["own"], rtol=1e-5, atol=1e-6)


def test_sliding_window_layers_stay_as_the_config_makes_them():
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4)
    model = transformers.Gemma2ForCausalLM(config)
    plain = transformers.DynamicCache(config=config).layers
    layers = preallocated_cache(model, 16).layers
    assert [type(layer) is DynamicLayer for layer in plain] == [hasattr(layer, "buffers") for layer in layers]
    assert any(hasattr(layer, "buffers") for layer in layers) and not all(hasattr(layer, "buffers") for layer in layers)


def test_a_model_that_is_not_a_transformers_causal_lm_gets_none():
    assert preallocated_cache(nn.Linear(2, 2), 8) is None


def test_the_sampling_loop_decodes_with_it():
    model, seen = _llama(), []
    keyword = teacher_samples._cache_keyword(model)
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get(keyword)), with_kwargs=True)
    teacher_samples._sampled(model, torch.zeros(2, 3, dtype=torch.long), 7, seed=0)
    assert len(seen) == 4 and all(cache is seen[0] for cache in seen)
    assert all(hasattr(layer, "buffers") for layer in seen[0].layers)
