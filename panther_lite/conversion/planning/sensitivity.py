"""How much each layer's output error reaches the model's output: the weights of the global
allocation's objective.

A layer's truncation error is a perturbation of its output; what matters is the perturbation
it causes at the model's output. To first order that is the layer's relative output error
times a gain that depends on the rest of the network (residual connections, normalisation,
the layers after it). The gain is measured once per layer on one calibration batch: add
Gaussian noise of relative size ``ε`` to the layer's output, run the model, and take how far
the model's output moved over ``ε²``: the next-token KL of its logits (a language model, a
classifier), else the relative squared change of its first floating-point tensor
(:mod:`.output_distance`). The allocation then minimises ``Σ_l gain_l² · e_l``.

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
from .output_distance import OutputProbe, probe_output

NOISE = 0.05


def probe_run(model: nn.Module, run: ModelRun, metric: str) -> Optional[OutputProbe]:
    """The :class:`~.output_distance.OutputProbe` of ``run(model)``'s output under ``metric``, with
    the batch's token mask (read while the model runs)."""
    masks: List[Optional[Tensor]] = [None]
    handle = model.register_forward_pre_hook(lambda module, args: masks.__setitem__(0, current_token_mask()))
    try:
        output = run(model)
    finally:
        handle.remove()
    return probe_output(output, masks[0], metric)


@measured_on_first
def output_gains(model: nn.Module, records: List[LayerRecord], run: ModelRun, metric: str = "auto") -> Dict[str, float]:
    """``{name: gain²}``: how far the model's output moves (:mod:`.output_distance` under
    ``metric``: the next-token KL of its logits, or the squared change of its first tensor), per
    squared relative noise added to each layer's output, when ``run(model)`` (one calibration
    batch) runs it (1.0 for every layer when the output holds no floating-point tensor or does not move)."""
    with evaluation_run(model):
        reference = probe_run(model, run, metric)
        if reference is None or not reference.moves():
            return {record.name: 1.0 for record in records}
        gains = {}
        for index, record in enumerate(records):
            generator = torch.Generator(device=reference.tensor.device).manual_seed(index)

            def perturb(module, args, output):
                noise = torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
                mask = current_token_mask()
                noise, real = zero_padding(noise, mask), zero_padding(output, mask)
                return output + NOISE * noise * (real.norm() / noise.norm().clamp_min(1e-30))

            handle = record.module.register_forward_hook(perturb)
            try:
                moved = probe_run(model, run, metric)
            finally:
                handle.remove()
            gains[record.name] = reference.distance(moved.tensor) / reference.reference() / NOISE**2
    return gains


def _hidden(output) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


@measured_on_first
def block_output_gains(model: nn.Module, blocks: List[nn.Module], run: ModelRun, metric: str = "auto") -> List[float]:
    """Squared gain from each block's output to the model's output, to first order, from one
    forward and one backward of ``run(model)``: for a random direction ``u`` at the output
    ``y`` with ``E[u uᵀ] = M`` (the metric of :mod:`.output_distance`: ``I``, or the Fisher
    information of the next-token distributions), ``E‖J_bᵀu‖² = tr(J_bᵀ M J_b)``, and Gaussian
    noise of relative size ``ε`` at the block's output ``x_b`` (``n_b`` entries) moves ``y`` by
    ``ε²‖x_b‖² tr(J_bᵀ M J_b)/n_b`` in that metric, so ``gain_b² = ‖x_b‖²‖J_bᵀu‖² / (n_b·ref)``
    (``ref``: ``‖y‖²``, or the count of real tokens). Parameters get no gradients (the first block's
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
            probe = probe_run(model, run, metric)
            if probe is None or not probe.tensor.requires_grad or not probe.moves():
                return [1.0] * len(blocks)
            hidden = [outputs[index] for index in range(len(blocks))]
            direction = probe.direction(torch.Generator().manual_seed(0))
            grads = torch.autograd.grad(probe.tensor, hidden, direction, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    reference = probe.reference()
    return [
        1.0 if grad is None else float(x.detach().double().norm() ** 2 * grad.double().norm() ** 2 / (x.numel() * reference))
        for x, grad in zip(hidden, grads)
    ]
