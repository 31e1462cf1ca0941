"""The tensors of expert e: what one MoE layer's experts are made of, independent of any family.

Legend: E = experts, L = local experts, R = rows an experts call computes, H = hidden (of the
experts), I = expert intermediate size, N1 = output features of the first projection(s).

An expert is a small, fixed set of named tensors (projections, optional biases, quantization scales),
each of the same shape and dtype for every expert. A quantized projection is two tensors: its values
(fp8, or MXFP4 blocks) and its block scales; both move, are copied and land together, so an expert is
ready only when its scales are too. An experts module stores each one
stacked over its experts: either `[E, *shape]` (transformers' stacked experts) or flattened,
`[E * rows, *shape[1:]]` (DBRX's w1/v1/w2). Placement, segments, copy plans, prefetch slots, weight
tables and loading handle these tensors by name and bytes only; `ExpertsMath` says how the
reference path combines them.
"""
from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import torch

from dwdp.kernels.block_scales import BlockQuant

# Every per-expert block in a segment or slot starts on this boundary (vectorised kernel loads).
ALIGN_BYTES = 16


@dataclass(frozen=True)
class ExpertTensor:
    """One named tensor of every expert of a layer.

    name: its name in weight tables and plans ("gate_up_proj", "down_proj_bias", "w1", ...).
    param: attribute path of the stacked tensor on the experts module ("gate_up_proj", "mlp.w1").
    shape: one expert's shape; dtype: its dtype (any: bf16 weights, fp32 scales, uint8 blocks).
    rows: 0 when stored stacked as [E, *shape]; r > 0 when flattened as [E * r, *shape[1:]].
    moves: True when each expert's copy lives on its owners and travels to the others; False when
        the whole tensor stays on every rank (small tensors such as biases, see dwdp.runtime.model).
    """

    name: str
    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int = 0
    moves: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's tensor."""
        count = 1
        for n in self.shape:
            count *= n
        return count * self.dtype.itemsize

    @property
    def stride_bytes(self) -> int:
        """Bytes one expert's tensor takes in a segment or slot (padded to ALIGN_BYTES)."""
        return -(-self.nbytes // ALIGN_BYTES) * ALIGN_BYTES

    def stored(self, module: torch.nn.Module) -> torch.Tensor:
        """The module's stacked tensor, as it holds it."""
        owner, _, leaf = self.param.rpartition(".")
        return getattr(module.get_submodule(owner) if owner else module, leaf)

    def stacked(self, module: torch.nn.Module, num_experts: int) -> torch.Tensor:
        """The module's tensor as [E, *shape] (a view; rows past E * rows, if any, are left out)."""
        param = self.stored(module)
        if self.rows:
            return param[: num_experts * self.rows].view(num_experts, *self.shape)
        return param[:num_experts]

    def replace(self, module: torch.nn.Module, local: torch.Tensor) -> None:
        """Swap the module's stacked tensor for `local` [L, *shape] (this rank's experts, or all of them
        for a tensor that does not move); dropping the old one frees the other experts."""
        owner, _, leaf = self.param.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, torch.nn.Parameter(local, requires_grad=False))

    def stored_shape(self, num_stored: int) -> tuple[int, ...]:
        """Shape of the module's stacked tensor holding `num_stored` experts."""
        if self.rows:
            return (num_stored * self.rows, *self.shape[1:])
        return (num_stored, *self.shape)

    def views_in(self, buffer: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """[count, *shape] views of `count` consecutive experts stored from byte `start` of the
        uint8 `buffer`, each at a multiple of `stride_bytes` (a view, never a copy)."""
        block = buffer[start : start + count * self.stride_bytes].view(count, self.stride_bytes)
        return block[:, : self.nbytes].view(self.dtype).view(count, *self.shape)


def glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) * up for [R, 2I] in the concatenated [gate; up] layout (transformers' default gate)."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)  # [R, I] each
        return act(g) * u

    return gate


@dataclass(frozen=True)
class QuantizedWeight:
    """A projection stored quantized: tensor `weight` holds its values (as stored: fp8 [N, K], or MXFP4
    blocks [N, K / 32, 16]), tensor `scale` its block scales; `quant` says how they combine."""

    weight: str
    scale: str
    quant: BlockQuant


@dataclass(frozen=True)
class ExpertsMath:
    """How one expert turns its rows x [R, H] into [R, H] from its named tensors.

        h = cat_j(x @ W_j^T + b_j)   over `first` (one fused gate_up, one up, or separate gate and up)
        y = gate(h) @ W_down^T + b_down, then `post_norm(y)` when set.

    transposed: weights stored [in, out] instead of [out, in] (read through a transposed view).
    weights_on_input: the routing weight scales the expert's input instead of its output (Llama 4).
    quantized: the projections stored quantized; each is dequantized one expert at a time on use.
    num_identity_experts: router ids E .. E + Z - 1 are identity experts: y = x (LongCat-Flash).
    """

    first: tuple[str, ...]
    first_bias: tuple[str | None, ...]
    down: str
    down_bias: str | None
    gate: Callable[[torch.Tensor], torch.Tensor]
    transposed: frozenset[str] = frozenset()
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    weights_on_input: bool = False
    num_identity_experts: int = 0
    gate_label: str = "custom"  # what the gate is, for reports ("silu * up", "module._apply_gate", ...)
    quantized: tuple[QuantizedWeight, ...] = ()

    @property
    def biases(self) -> tuple[str, ...]:
        """Names of the bias tensors, first projection(s) then down."""
        return tuple(b for b in (*self.first_bias, self.down_bias) if b is not None)

    def quantization(self, weight: str) -> QuantizedWeight | None:
        """How projection `weight` is quantized, or None when it is stored dense."""
        return next((q for q in self.quantized if q.weight == weight), None)

    @property
    def scales(self) -> tuple[str, ...]:
        return tuple(q.scale for q in self.quantized)


@dataclass(frozen=True)
class ExpertsSpec:
    """Everything dwdp needs to know about one MoE layer's experts module."""

    num_experts: int
    tensors: tuple[ExpertTensor, ...]
    math: ExpertsMath
    extras: dict = field(default_factory=dict, compare=False)  # adapter-specific, e.g. kernel hints

    def tensor(self, name: str) -> ExpertTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no expert tensor named {name!r}; this layer has {[t.name for t in self.tensors]}")

    @property
    def hidden_size(self) -> int:
        """H: the features an expert reads and writes."""
        down = self.tensor(self.math.down)  # [H, I], [I, H] transposed, or MXFP4 blocks [H, I / 32, 16]
        return down.shape[1] if down.name in self.math.transposed else down.shape[0]

    @property
    def moving(self) -> tuple[ExpertTensor, ...]:
        """The tensors that live with their expert's owners and are copied to the other ranks."""
        return tuple(t for t in self.tensors if t.moves)

    @property
    def replicated(self) -> tuple[ExpertTensor, ...]:
        return tuple(t for t in self.tensors if not t.moves)

    def signature(self) -> tuple:
        """What must agree between layers that share one segment layout."""
        return self.num_experts, tuple((t.name, t.shape, t.dtype, t.moves) for t in self.tensors)


def place_biases(spec: ExpertsSpec, policy: str) -> ExpertsSpec:
    """`spec` with its biases marked as moving with their expert or staying on every rank.

    "auto" keeps them on every rank when the biases of all E experts take no more bytes than one
    expert's weights: they then cost less memory than one more local expert, and moving them would
    add two tiny copies per remote expert. Otherwise (or with "move") they travel with their expert.
    """
    biases = set(spec.math.biases)
    if not biases:
        return spec
    bias_bytes = spec.num_experts * sum(t.nbytes for t in spec.tensors if t.name in biases)
    weight_bytes = sum(t.nbytes for t in spec.tensors if t.name not in biases)
    replicate = policy == "replicate" or (policy == "auto" and bias_bytes <= weight_bytes)
    tensors = tuple(dataclasses.replace(t, moves=not replicate) if t.name in biases else t for t in spec.tensors)
    return dataclasses.replace(spec, tensors=tensors)
