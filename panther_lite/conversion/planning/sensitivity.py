"""How much each layer's output error reaches the model's output: the weights of the global
allocation's objective.

A layer's truncation error is a perturbation of its output; what matters is the perturbation
it causes at the model's output. To first order that is the layer's relative output error
times a gain that depends on the rest of the network (residual connections, normalisation,
the layers after it). The gain is measured once per layer on one calibration batch: add
Gaussian noise of relative size ``ε`` to the layer's output, run the model, and take the
relative change of the model's output (its first floating-point tensor) over ``ε``. The
allocation then minimises ``Σ_l gain_l² · e_l``.

Only real tokens count: where the batch's attention mask lines up with an output (or a layer's
output), its padded positions are zeroed before any norm and get no noise
(:mod:`~panther_lite.conversion.calibration.tokens`).

Block by block, a layer's gain is measured to its block's output and multiplied by the
block's own gain to the model's output (:func:`block_output_gains`, first order, one forward
and backward for all blocks), so no full forward per layer is needed.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..calibration.batches import ModelRun, evaluation_run
from ..calibration.tokens import current_token_mask, zero_padding
from ..process_groups.statistics import measured_on_first
from ..records import LayerRecord

NOISE = 0.05


def _first_tensor(output) -> Optional[Tensor]:
    """The first floating-point tensor in a model's output (a Tensor, a tuple/list, a dict or
    a Hugging Face ``ModelOutput``)."""
    if isinstance(output, Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def _real_output(model: nn.Module, run: ModelRun) -> Optional[Tensor]:
    """The first floating-point tensor of ``run(model)``'s output, its padded positions zeroed
    (the token mask is read while the model runs)."""
    masks: List[Optional[Tensor]] = [None]
    handle = model.register_forward_pre_hook(lambda module, args: masks.__setitem__(0, current_token_mask()))
    try:
        output = _first_tensor(run(model))
    finally:
        handle.remove()
    return None if output is None else zero_padding(output, masks[0])


@measured_on_first
def output_gains(model: nn.Module, records: List[LayerRecord], run: ModelRun) -> Dict[str, float]:
    """``{name: gain²}``: the squared relative change of the model's output per relative
    noise added to each layer's output, when ``run(model)`` (one calibration batch) runs it
    (1.0 for every layer when the output holds no floating-point tensor or does not move)."""
    with evaluation_run(model):
        reference = _real_output(model, run)
        if reference is None or not bool(reference.norm() > 0):
            return {record.name: 1.0 for record in records}
        gains = {}
        for index, record in enumerate(records):
            generator = torch.Generator(device=reference.device).manual_seed(index)

            def perturb(module, args, output):
                noise = torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
                mask = current_token_mask()
                noise, real = zero_padding(noise, mask), zero_padding(output, mask)
                return output + NOISE * noise * (real.norm() / noise.norm().clamp_min(1e-30))

            handle = record.module.register_forward_hook(perturb)
            try:
                moved = _real_output(model, run)
            finally:
                handle.remove()
            gains[record.name] = float(((moved - reference).norm() / reference.norm() / NOISE) ** 2)
    return gains


def _hidden(output) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


@measured_on_first
def block_output_gains(model: nn.Module, blocks: List[nn.Module], run: ModelRun) -> List[float]:
    """Squared gain from each block's output to the model's output, to first order, from one
    forward and one backward of ``run(model)``: for a random direction ``u`` at the output
    ``y``, ``E‖J_bᵀu‖² = ‖J_b‖_F²``, and Gaussian noise of relative size ``ε`` at the block's
    output ``x_b`` (``n_b`` entries) moves ``y`` by ``ε‖x_b‖‖J_b‖_F/√n_b`` in expectation, so
    ``gain_b² = ‖x_b‖²‖J_bᵀu‖² / (n_b‖y‖²)``. Parameters get no gradients (the first block's
    input is made the graph's leaf); 1.0 for every block when the output does not move."""
    if not blocks:
        return []
    outputs: Dict[int, Tensor] = {}

    def leaf_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden = hidden.detach().requires_grad_()
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    def keep(index):
        return lambda module, args, output: outputs.__setitem__(index, _hidden(output))

    handles = [blocks[0].register_forward_pre_hook(leaf_input, with_kwargs=True)]
    handles += [block.register_forward_hook(keep(index)) for index, block in enumerate(blocks)]
    try:
        with evaluation_run(model), torch.enable_grad():
            output = _first_tensor(run(model))
            if output is None or not output.requires_grad or not bool(output.norm() > 0):
                return [1.0] * len(blocks)
            direction = torch.randn(output.shape, generator=torch.Generator().manual_seed(0)).to(output)
            hidden = [outputs[index] for index in range(len(blocks))]
            grads = torch.autograd.grad(output, hidden, direction, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    reference = float(output.detach().double().norm() ** 2)
    return [
        1.0 if grad is None else float(x.detach().double().norm() ** 2 * grad.double().norm() ** 2 / (x.numel() * reference))
        for x, grad in zip(hidden, grads)
    ]
