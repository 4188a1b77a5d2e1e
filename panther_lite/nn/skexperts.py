"""SKExperts: sketched mixture-of-experts weights, a drop-in for a model's experts module.

**The seam.** A transformers mixture-of-experts block (Mixtral, Qwen2/Qwen3-MoE, OLMoE,
DeepSeek-, gpt-oss-style) computes its routing and then calls
``self.experts(hidden_states, top_k_index, top_k_weights)``; the experts module holds the
3-D weights (``gate_up_proj`` ``[E, 2·inter, hidden]``, ``down_proj`` ``[E, hidden, inter]``)
and its forward dispatches on ``config._experts_implementation`` (``eager``, ``batched_mm``,
``grouped_mm``; ``transformers.integrations.moe``). :class:`SKExperts` replaces that module
whole: same forward signature and result, so the model's router and block run unchanged;
``block.experts = SKExperts.from_experts(block.experts, num_terms, low_rank)`` is the swap.

Everything model-specific stays the model's: SKExperts keeps a copy of the dense module
without its expert weights (``shell``: activation, ``_apply_gate`` — gpt-oss's clamped
SwiGLU included —, flags such as ``has_gate``/``is_transposed``, a post-expert norm, and
the *same* ``config`` object; held outside the module tree, :mod:`~panther_lite.nn.experts_shell`), so ``model.set_experts_implementation("batched_mm")`` switches
SKExperts too: it runs the sketched schedule of that name
(:mod:`~panther_lite.nn.experts_routing`); names with no sketched schedule (GPU kernels
for dense weights such as ``deepgemm``/``sonicmoe``) and a standalone module run ``grouped_mm``.

Swapping the 3-D parameters for a tensor-like stand-in inside the dense module was the
alternative: transformers' implementations index and transpose those tensors and pass them
to ``grouped_mm`` kernels, so a stand-in would have to fake dense weights (or materialise
them), which is what a sketch must avoid.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .experts_routing import SCHEDULES
from .experts_shell import ShellHolder, copy_sharing_config, expert_activation, expert_finish, weightless_copy
from .layer_base import INITS
from .low_rank_fit import FIT_METHODS
from .rank_selection import SketchSize
from .stacked_linear import SKStackedLinear
from .validation import check_choice, check_materialized, check_positive_int, check_tensor

__all__ = ["SKExperts", "IMPLEMENTATIONS", "dense_projections"]

IMPLEMENTATIONS = tuple(SCHEDULES)
_DEFAULT_IMPLEMENTATION = "grouped_mm"


def dense_projections(experts: nn.Module) -> List[Tuple[str, Tensor, Optional[Tensor]]]:
    """``[(name, weight, bias)]`` of the up (``gate_up_proj`` or ``up_proj``) and down
    projections of a transformers-style experts module, checked to fit together."""
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError("SKExperts does not support expert-parallel experts modules (_is_expert_parallel=True)")
    first = "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"
    found = []
    for name in (first, "down_proj"):
        weight = getattr(experts, name, None)
        if not isinstance(weight, Tensor) or weight.dim() != 3:
            raise TypeError(
                f"experts must hold 3-D expert weights {first!r} and 'down_proj' as transformers' experts modules "
                f"do; {type(experts).__name__}.{name} is {type(weight).__name__}"
            )
        check_tensor(f"experts.{name}", weight)
        bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
        found.append((name, weight, bias))
    _check_shapes(experts, found)
    return found


def _check_shapes(experts: nn.Module, found) -> None:
    (up_name, up, _), (_, down, _) = found
    transposed = bool(getattr(experts, "is_transposed", False))
    up_out, hidden = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    down_out, inter = (down.shape[2], down.shape[1]) if transposed else (down.shape[1], down.shape[2])
    expected_up = 2 * inter if up_name == "gate_up_proj" else inter
    if up.shape[0] != down.shape[0] or up_out != expected_up or down_out != hidden:
        raise ValueError(
            f"experts weights do not fit together: {up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} "
            f"(is_transposed={transposed}) should map hidden -> {'2·' if up_name == 'gate_up_proj' else ''}inter "
            "and inter -> hidden for the same number of experts"
        )


def _check_projection_keys(name: str, value: Optional[Mapping], names: Tuple[str, ...], what: str) -> Mapping:
    """``value`` (a mapping from projection names, or None for ``{}``); ValueError naming the
    argument when it is not a mapping or names another projection."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not set(value) <= set(names):
        keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(f"{name} must map projection names {names} to {what}, got {keys}")
    return value


def _projection_sizes(
    sizes: Optional[Mapping[str, Tuple[int, int]]], names: Tuple[str, ...], num_terms: int, low_rank: int
) -> Dict[str, Tuple[int, int]]:
    """``(num_terms, low_rank)`` of each projection: ``sizes[name]`` where given, else the shared pair."""
    sizes = _check_projection_keys("sizes", sizes, names, "(num_terms, low_rank) pairs")
    found = {}
    for name in names:
        pair = sizes.get(name, (num_terms, low_rank))
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"sizes[{name!r}] must be a (num_terms, low_rank) pair, got {pair!r}")
        found[name] = (check_positive_int(f"sizes[{name!r}] num_terms", pair[0]),
                       check_positive_int(f"sizes[{name!r}] low_rank", pair[1]))
    return found


class SKExperts(ShellHolder):
    r"""Sketched experts: each expert's projections are sketched linear maps with stacked factors.

    For every projection of the dense experts module (``gate_up_proj`` — or ``up_proj``
    without a gate — and ``down_proj``), an :class:`~panther_lite.nn.SKStackedLinear` of
    the same name holds per-expert factors ``S1`` ``(E, in, Lk)``, ``U1`` ``(E, Lk, out)``,
    ``U2`` ``(E, in, Lk)``, ``S2`` ``(E, Lk, out)`` (and the biases, gpt-oss), and expert
    ``e`` computes SKLinear's ``y = 1/(2L)·((x S1[e]) U1[e] + (x U2[e]) S2[e]) + b[e]``. The
    forward is the dense module's: up projection, the model's gate (``_apply_gate``) or
    activation, down projection, optional post-expert norm, routing weights, sum over the
    top-k (see the module docstring for how it plugs into transformers).

    Args:
        experts: the dense experts module to represent: transformers' ``MixtralExperts``,
            ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``GptOssExperts``, ...
            or any module with 3-D ``gate_up_proj``/``up_proj`` and ``down_proj`` in their
            layout (``has_gate``, ``has_bias``, ``is_transposed`` attributes as set by
            transformers' ``use_experts_implementation``; defaults: gate, no bias, not
            transposed). It is not modified. Its weights are fitted with ``init``; weights on
            the meta device (a model built under ``torch.device("meta")``) are drawn with the
            dense layers' default init instead (training from scratch), or, with
            ``device="meta"``, left empty for ``load_state_dict``.
        num_terms, low_rank: ``L`` and ``k`` of every expert's projections.
        sizes: optional ``(num_terms, low_rank)`` per projection name (e.g.
            ``{"down_proj": (1, 8)}``), replacing ``num_terms``/``low_rank`` for it (every
            expert of one projection shares its size: the factors are stacked).
        init: ``"svd"`` (each expert's best rank-``2Lk`` fit; at ``2Lk >= min(in, out)`` the
            experts are reproduced exactly) or ``"sketch"`` (random sign sketches).
        seed: seeds the sketches and randomized fits.
        fit: ``"auto"``, ``"exact"`` or ``"randomized"`` (see
            :meth:`~panther_lite.nn.layer_base.SketchedLayer.initialize_from_weight`).
        gram: with ``init="svd"``, optional per-expert calibration Grams by projection name,
            ``{"gate_up_proj": (E, hidden, hidden), "down_proj": (E, inter, inter)}`` (Gram of
            the rows each expert received): the fit then minimises each expert's output error.
        implementation: ``"eager"``, ``"batched_mm"`` or ``"grouped_mm"``; None (default)
            follows the model's ``config._experts_implementation``.
        device, dtype: of the factors (default: the experts' weights').

    Shape:
        - ``hidden_states``: ``(T, hidden)``; ``top_k_index``: ``(T, K)`` integer expert ids in
          ``[0, E)``; ``top_k_weights``: ``(T, K)``.
        - Output: ``(T, hidden)`` in ``hidden_states``' dtype.

    Under autocast the products run in the autocast dtype (float64 stays float64), as the
    dense module's ``F.linear`` calls do. ``torch.compile(fullgraph=True)`` compiles the
    ``grouped_mm`` and ``batched_mm`` schedules; ``eager`` loops over the experts that got
    tokens (data-dependent), so it compiles only with graph breaks, as transformers' does.
    """

    def __init__(
        self,
        experts: nn.Module,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        fit: str = "auto",
        gram: Optional[Mapping[str, Tensor]] = None,
        implementation: Optional[str] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
        sizes: Optional[Mapping[str, Tuple[int, int]]] = None,
    ) -> None:
        super().__init__()
        if not isinstance(experts, nn.Module):
            raise TypeError(f"experts must be an nn.Module (a model's experts module), got {type(experts).__name__}")
        check_choice("init", init, INITS)
        check_choice("fit", fit, FIT_METHODS)
        self.implementation = implementation
        projections = dense_projections(experts)
        self._projection_names = tuple(name for name, _, _ in projections)
        grams = _check_projection_keys("gram", gram, self._projection_names, "per-expert Grams (E, in, in)")
        pairs = _projection_sizes(sizes, self._projection_names, num_terms, low_rank)
        transposed = bool(getattr(experts, "is_transposed", False))
        options = dict(init=init, seed=seed, fit=fit, device=device, dtype=dtype, transposed=transposed)
        built = [
            _sketch_projection(weight, bias, *pairs[name], gram=grams.get(name), **options)
            for name, weight, bias in projections
        ]
        self.hold_shell(weightless_copy(experts, projections), built[0].S1.device, dtype)
        for name, projection in zip(self._projection_names, built):
            self.add_module(name, projection)

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        gram: Optional[Mapping[str, Tensor]] = None,
        fit: str = "auto",
        implementation: Optional[str] = None,
        sizes: Optional[Mapping[str, Tuple[int, int]]] = None,
    ) -> "SKExperts":
        """SKExperts (same device and dtype) approximating ``experts``: each expert's best
        rank-``2Lk`` fit with ``init="svd"`` (optionally from per-expert Grams, see the class),
        exact at full rank; ``sizes`` sets a projection's own ``(num_terms, low_rank)``. The
        model's router keeps calling it unchanged:
        ``block.experts = SKExperts.from_experts(block.experts, L, k)``."""
        return cls(
            experts, num_terms, low_rank, init=init, seed=seed, gram=gram, fit=fit, implementation=implementation,
            sizes=sizes,
        )

    @property
    def implementation(self) -> Optional[str]:
        """The schedule forced for this module, or None to follow ``config._experts_implementation``."""
        return self._implementation

    @implementation.setter
    def implementation(self, value: Optional[str]) -> None:
        if value is not None:
            check_choice("implementation", value, IMPLEMENTATIONS)
        self._implementation = value

    @property
    def active_implementation(self) -> str:
        """The schedule the next forward runs: :attr:`implementation`, else the model's
        ``config._experts_implementation`` when it has a sketched schedule, else ``"grouped_mm"``."""
        if self._implementation is not None:
            return self._implementation
        name = getattr(getattr(self.shell, "config", None), "_experts_implementation", None)
        return name if name in SCHEDULES else _DEFAULT_IMPLEMENTATION

    def projections(self) -> Tuple[SKStackedLinear, SKStackedLinear]:
        """The up (``gate_up_proj``/``up_proj``) and down projections, in the order applied."""
        return tuple(self._modules[name] for name in self._projection_names)

    @property
    def num_experts(self) -> int:
        return self.projections()[0].num_experts

    @property
    def hidden_dim(self) -> int:
        return self.projections()[0].in_features

    @property
    def intermediate_dim(self) -> int:
        return self.projections()[1].in_features

    def activate(self, hidden: Tensor) -> Tensor:
        """The dense module's gate (``_apply_gate``, e.g. ``act(gate) * up``) or, without a
        gate projection, its activation: ``(S, out_up) -> (S, inter)``."""
        return expert_activation(self.shell, hidden)

    def finish(self, hidden: Tensor) -> Tensor:
        """The dense module's post-expert norm, where it has one."""
        return expert_finish(self.shell, hidden)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        self._check_routing(hidden_states, top_k_index, top_k_weights)
        return SCHEDULES[self.active_implementation](self, hidden_states, top_k_index, top_k_weights)

    def _check_routing(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(
                f"hidden_states must have shape (tokens, hidden_dim={self.hidden_dim}), got {tuple(hidden_states.shape)}"
            )
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0] or top_k_index.is_floating_point():
            raise ValueError(
                f"top_k_index must be an integer tensor of shape (tokens={hidden_states.shape[0]}, top_k), "
                f"got {top_k_index.dtype} {tuple(top_k_index.shape)}"
            )
        if top_k_weights.shape != top_k_index.shape or not top_k_weights.is_floating_point():
            raise ValueError(
                f"top_k_weights must be a floating tensor of top_k_index's shape {tuple(top_k_index.shape)}, "
                f"got {top_k_weights.dtype} {tuple(top_k_weights.shape)}"
            )

    def effective_weights(self) -> Dict[str, Tensor]:
        """The dense expert weights this module applies, by projection name, in the dense
        module's layout (e.g. ``gate_up_proj`` ``(E, 2·inter, hidden)``); differentiable."""
        return {name: projection.effective_weight() for name, projection in zip(self._projection_names, self.projections())}

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The dense experts module (its original class, sharing its ``config``) computing
        the same function, with the effective weights (and biases) as parameters."""
        dense = copy_sharing_config(self.shell)
        for name, projection in zip(self._projection_names, self.projections()):
            dense.register_parameter(name, nn.Parameter(projection.effective_weight().clone()))
            if projection.bias is not None:
                dense.register_parameter(f"{name}_bias", nn.Parameter(projection.bias.clone()))
        return dense

    def parameter_counts(self) -> SketchSize:
        """Trainable (S factors + biases) and stored (plus U buffers) counts of both
        projections (the shell's own parameters, e.g. a post-expert norm, not included)."""
        counts = [projection.parameter_counts() for projection in self.projections()]
        return SketchSize(sum(c.trainable for c in counts), sum(c.stored for c in counts))

    @property
    def sizes(self) -> Dict[str, Tuple[int, int]]:
        """``(num_terms, low_rank)`` of each projection, by name."""
        return {name: (p.num_terms, p.low_rank) for name, p in zip(self._projection_names, self.projections())}

    def extra_repr(self) -> str:
        first, *_ = sizes = set(self.sizes.values())
        size = f"num_terms={first[0]}, low_rank={first[1]}" if len(sizes) == 1 else f"sizes={self.sizes}"
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"{size}, implementation={self._implementation!r}"
        )


def _sketch_projection(
    weight: Tensor, bias: Optional[Tensor], num_terms: int, low_rank: int, *, init: str, seed, fit: str,
    gram: Optional[Tensor], device, dtype, transposed: bool,
) -> SKStackedLinear:
    """The SKStackedLinear of one dense 3-D projection (see :class:`SKExperts` for how meta
    weights are treated); every check runs before any fit."""
    experts, rows, cols = weight.shape
    in_features, out_features = (rows, cols) if transposed else (cols, rows)
    device = weight.device if device is None else torch.device(device)
    layer = nn.utils.skip_init(
        SKStackedLinear, experts, in_features, out_features, num_terms, low_rank, None, bias is not None,
        device=device, dtype=weight.dtype if dtype is None else dtype, transposed=transposed, init=init, seed=seed,
    )
    if gram is not None and weight.is_meta:
        raise ValueError("gram needs the experts' weights, which are on the meta device")
    if layer.S1.is_meta:
        return layer
    if weight.is_meta:
        layer.reset_parameters()
        return layer
    layer.initialize_from_weight(weight, init=init, gram=gram, fit=fit)
    if bias is not None:
        check_materialized("bias", bias)
        with torch.no_grad():
            layer.bias.copy_(bias)
    return layer
