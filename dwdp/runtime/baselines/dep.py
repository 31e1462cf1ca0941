"""DEP baseline: attention data parallel + expert parallel with two all-to-alls per MoE layer.

Legend: T = tokens of this rank, k = experts per token, S = T * k token-expert pairs sent, R = rows
an experts call computes (those this rank receives), G = ranks, E = experts, L = local experts of a
rank (the most any rank owns), H = hidden.

Rank r keeps experts [starts[r], starts[r+1]) of every MoE layer (a contiguous disjoint split).
In each MoE layer, after the model's own router:
  1. pairs are sorted by expert, hence by owning rank; the per-(destination, local expert) counts
     [G, L] go out with one all-to-all (equal splits), so every rank learns what it receives;
  2. dispatch: the rows go to their owners with `all_to_all_single` (uneven splits);
  3. the owner runs its experts on the rows grouped by local expert;
  4. combine: results return with a second `all_to_all_single`, then are weighted and summed.

Every all-to-all is a barrier: each rank must enter every MoE layer's collectives in the same
order, zero tokens or not. When per-rank work differs, ranks still advance in lockstep steps: in
each step every rank either runs one forward or, if it has no work left, `DEPModel.idle_step()`,
which enters each MoE layer's three all-to-alls with zero rows of its own (and still computes the
rows other ranks send to its experts). The caller must agree on the number of steps beforehand.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dwdp.models.adapters import find_experts, route_experts
from dwdp.runtime.expert_math import combine, expert_mlp, plain_routing_layers, sort_by_expert
from dwdp.models.expert_tensors import ExpertsSpec
from dwdp.runtime.group import DWDPGroup, init_group
from dwdp.runtime.model import MemoryReport
from dwdp.runtime.wrapping import ModelWrapper, dense_bytes, tensor_bytes

DEP_IMPLEMENTATION = "dwdp_dep"


def expert_split(num_experts: int, group_size: int) -> tuple[int, ...]:
    """Starts of each rank's contiguous expert range: rank r owns [starts[r], starts[r+1]); G + 1 entries."""
    if not 1 <= group_size <= num_experts:
        raise ValueError(
            f"group_size={group_size} must be in [1, num_experts={num_experts}]: every rank needs an expert")
    return tuple(r * num_experts // group_size for r in range(group_size + 1))


@dataclass
class CommStats:
    """Collectives of one rank since creation (or the last `reset`), in call order.

    call_s[c] is the wall time of collective c on this rank: its own transfer plus the time it sat
    blocked until the slowest rank entered. Call sequences are identical on every rank, so the
    wait of rank r in call c is `call_s[r][c] - min over ranks of call_s[.][c]` (the last rank to
    arrive waits for no one): see `waits_from_calls`.
    """

    call_s: list[float] = field(default_factory=list)
    rows_sent: int = 0
    rows_received: int = 0
    idle_steps: int = 0

    @property
    def comm_s(self) -> float:
        return sum(self.call_s)

    def reset(self) -> None:
        self.__init__()


def waits_from_calls(call_s_per_rank: list[list[float]]) -> list[float]:
    """Per-rank seconds spent waiting for other ranks, from every rank's `CommStats.call_s`."""
    if len({len(c) for c in call_s_per_rank}) > 1:
        raise ValueError(f"ranks made different numbers of collectives: {[len(c) for c in call_s_per_rank]}")
    fastest = [min(calls) for calls in zip(*call_s_per_rank)]
    return [sum(c - f for c, f in zip(calls, fastest)) for calls in call_s_per_rank]


@dataclass
class DEPRuntime:
    """What the DEP experts function of one MoE layer needs; attached to its experts module."""

    rank: int
    size: int
    process_group: object | None
    starts: tuple[int, ...]       # G + 1 expert range starts
    max_local: int                # L
    pad_index: torch.Tensor       # [G * L] int64: expert id at (rank, local slot), E for an empty slot
    stats: CommStats
    spec: ExpertsSpec             # the layer's expert tensors and math


def _all_to_all(rt: DEPRuntime, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
    """out <- all-to-all of inp over the group; timed into rt.stats.call_s."""
    if rt.process_group is None:  # one rank: everything stays here
        out.copy_(inp)
        return
    start = time.perf_counter()
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=rt.process_group)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)  # nccl returns before the transfer is done
    rt.stats.call_s.append(time.perf_counter() - start)


def dep_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H]; T may be 0."""
    rt: DEPRuntime | None = getattr(self, "_dep_runtime", None)
    if rt is None:
        raise RuntimeError(
            f"{type(self).__name__} is set to the 'dwdp_dep' experts implementation but was not wrapped by DEPModel")
    top_k = top_k_index.shape[1]
    hidden = hidden_states.shape[1]
    num_experts, size, max_local = rt.starts[-1], rt.size, rt.max_local
    # Sorting by expert id sorts by owning rank too: each destination's rows are one contiguous chunk.
    perm, counts = sort_by_expert(top_k_index, num_experts)                     # [S], [E]
    send_counts = torch.cat([counts, counts.new_zeros(1)])[rt.pad_index]        # [G * L]
    recv_counts = torch.empty_like(send_counts)                                 # [G * L]
    _all_to_all(rt, recv_counts, send_counts)
    send_splits = send_counts.view(size, max_local).sum(1).tolist()             # G
    recv_matrix = recv_counts.view(size, max_local)                             # [G, L] from each source
    recv_splits = recv_matrix.sum(1).tolist()                                   # G

    x_send = hidden_states[perm // top_k]                                       # [S, H]
    x_recv = hidden_states.new_empty(sum(recv_splits), hidden)                  # [R, H]
    _all_to_all(rt, x_recv, x_send, recv_splits, send_splits)

    # Received rows come source by source, each source's rows by local expert: regroup by expert.
    local_slot = torch.arange(max_local, device=recv_counts.device).repeat(size)  # [G * L]
    row_expert = torch.repeat_interleave(local_slot, recv_counts)               # [R]
    _, regroup = torch.sort(row_expert, stable=True)                            # [R]
    num_local = rt.starts[rt.rank + 1] - rt.starts[rt.rank]
    rows_per_expert = recv_matrix.sum(0)[:num_local].tolist()
    views = {t.name: t.stored(self).unbind(0) for t in rt.spec.tensors}        # this rank's experts only
    y_grouped = expert_mlp(rt.spec.math, x_recv[regroup], rows_per_expert, views)  # [R, H] grouped by expert
    y_recv = torch.empty_like(y_grouped)                                        # [R, H] in arrival order
    y_recv[regroup] = y_grouped

    y_send = hidden_states.new_empty(x_send.shape)                              # [S, H] in perm order
    _all_to_all(rt, y_send, y_recv, send_splits, recv_splits)
    rt.stats.rows_sent += x_send.shape[0]
    rt.stats.rows_received += x_recv.shape[0]
    return combine(y_send, perm, top_k_weights, hidden_states.dtype)


class DEPModel(ModelWrapper):
    """One rank of an expert-parallel (DEP) group around `model`, called exactly like `model`.

    model: a transformers 5 MoE model of a supported family, identical on every rank (same
        weights); modified in place: each experts module keeps only this rank's expert range.
    group: DWDPGroup whose process group carries the all-to-alls (gloo on CPU, nccl on GPU);
        None joins the env:// world (torchrun) or, without one, a one-rank group.

    Every rank must make the same sequence of calls: one `forward` (any number of tokens, any
    batch shape) or one `idle_step()` per step. `stats` holds the timed collectives.
    """

    def __init__(self, model: torch.nn.Module, group: DWDPGroup | None = None):
        super().__init__()
        # Validates the model before any collective.
        layers = plain_routing_layers(find_experts(model), "DEPModel")
        group = group if group is not None else init_group()
        num_experts = layers[0].spec.num_experts
        for layer in layers:
            if layer.spec.num_experts != num_experts:
                raise ValueError(
                    f"{layer.name} has {layer.spec.num_experts} experts; expected {num_experts} like {layers[0].name}")
        starts = expert_split(num_experts, group.size)
        lo, hi = starts[group.rank], starts[group.rank + 1]
        max_local = max(b - a for a, b in zip(starts, starts[1:]))
        pad = [[starts[r] + j if starts[r] + j < starts[r + 1] else num_experts for j in range(max_local)]
               for r in range(group.size)]
        full = tensor_bytes(t.stored(layer.module) for layer in layers for t in layer.spec.tensors)
        device = layers[0].spec.tensors[0].stored(layers[0].module).device
        self.stats = CommStats()
        for layer in layers:
            for t in layer.spec.tensors:
                # Clones, so dropping the stacked [E, ...] tensors frees the other ranks' experts.
                t.replace(layer.module, t.stacked(layer.module, num_experts).detach()[lo:hi].clone())  # [hi - lo, ...]
            layer.module._dep_runtime = DEPRuntime(
                group.rank, group.size, group.process_group if group.size > 1 else None, starts, max_local,
                torch.tensor(pad, dtype=torch.long, device=device).reshape(-1), self.stats, layer.spec,
            )
        local_tensors = [t.stored(layer.module) for layer in layers for t in layer.spec.tensors]
        self.model = model
        self.group = group
        self.starts = starts
        # What hidden states travel as (the experts' weights may be quantized).
        self.hidden_dtype = model.get_input_embeddings().weight.dtype
        self.experts_modules = [layer.module for layer in layers]
        route_experts(model, layers, DEP_IMPLEMENTATION, dep_experts_forward)
        self.memory = MemoryReport(
            full_expert_bytes=full, local_expert_bytes=tensor_bytes(local_tensors), prefetch_buffer_bytes=0,
            dense_bytes=dense_bytes(model, local_tensors),
        )

    @torch.no_grad()
    def idle_step(self) -> None:
        """Take part in one step without work of its own: every MoE layer's all-to-alls, zero rows
        sent, the rows other ranks route to this rank's experts computed and returned."""
        for module in self.experts_modules:
            spec = module._dep_runtime.spec
            weight = spec.tensor(spec.math.down).stored(module)                # [L, ...]
            empty = weight.new_empty(0, spec.hidden_size, dtype=self.hidden_dtype)  # [0, H]
            index = torch.empty(0, 1, dtype=torch.long, device=weight.device)  # [0, 1]
            dep_experts_forward(module, empty, index, empty.new_empty(0, 1))
        self.stats.idle_steps += 1

    def close(self) -> None:
        """Nothing to release (the process group belongs to the caller)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
