"""The tiny models and calibration batches the multi-process tests convert (the same in the test
process and in every rank)."""
from __future__ import annotations

import contextlib

import torch


def tiny_llama(kind: str = "llama"):
    import transformers

    torch.manual_seed(0)
    if kind == "mixtral":  # 4 experts, 2 per token: per-expert statistics
        config = transformers.MixtralConfig(
            vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        )
        model = transformers.MixtralForCausalLM(config)
        model.set_experts_implementation("eager")
        return model.eval()
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def batches(count: int = 4, size: int = 2, length: int = 12):
    generator = torch.Generator().manual_seed(1)
    return [dict(input_ids=torch.randint(0, 48, (size, length), generator=generator)) for _ in range(count)]


def logits_score(model):
    """A ``tune`` score for ``model`` as it is now: minus the mean squared change of its logits on
    one batch (0 for the model as it is now)."""
    probe = batches(1, length=8)[0]
    with torch.no_grad():
        reference = model(**probe).logits

    def evaluate(converted) -> float:
        with torch.no_grad():
            return -float((converted(**probe).logits - reference).square().mean())

    return evaluate


@contextlib.contextmanager
def counting_fits(model, built: list):
    """For the duration, each registered layer kind's ``build`` (called once per fit) appends the
    dotted name in ``model`` of the layer it fits to ``built``."""
    from panther_lite.conversion.kinds.registry import registered_kinds

    names, kinds = {id(module): name for name, module in model.named_modules()}, registered_kinds()
    for kind in kinds:
        def build(module, *args, _original=kind.build, **kwargs):
            built.append(names.get(id(module), "?"))
            return _original(module, *args, **kwargs)

        kind.build = build  # an instance attribute: shadows the method
    try:
        yield
    finally:
        for kind in kinds:
            vars(kind).pop("build", None)
