"""Expert parallelism: each EP rank owns E/ep experts; tokens travel to their expert's rank and back
by all-to-all, autograd-correct, with no device-to-host sync (docs/expert_parallel.md).

- Static capacity: each rank sends every peer exactly
  ``C = min(ceil(capacity_factor x T x K / ep), T x min(K, E / ep))`` rows, the first ``count`` real
  (token, k) slots and the rest empty (expert id -1, which every backend skips). The slots a rank
  sends one peer are laid out in (expert, token) order and those past C are dropped: they add
  nothing to their token's output (its other experts and the residual still carry it) and are
  counted per expert. ``[parallelism] expert_capacity_overflow`` tells the trainer what to do with a
  step that dropped any: apply it and log the count (``"drop"``, a GShard / Megatron capacity
  factor) or stop before the update (``"stop"``). A factor >= ep never drops (C then holds every
  slot a rank can send a peer).
- Expert weights are DTensors on the (dp_replicate, dp_shard_mod_ep, ep) mesh: Shard(0) over ``ep``,
  Shard(1) over ``dp_shard_mod_ep``, all-gathered in the forward by an autograd-aware collective
  (not a nested FSDP unit, whose hooks break a ``fullgraph`` compile of the block);
  :func:`finish_expert_grads` completes the gradient reduction after backward.
- Received rows enter the MoE backend with their local expert ids as K = 1 routing; routing weights
  are applied on the source rank in float32, so the router's gradient never crosses the network.
- ``expert_parallel_chunks`` = P > 1 splits a layer's tokens into P chunks: all dispatches are
  issued first, each chunk's combine travels under the next chunk's experts (compiled, this needs
  the reorder pass in ``parallelisms/compile.py``). P = 1 is the unchunked path exactly.
- Every rank must run the same collectives in the same order, so a backend's output must depend on
  its input rows even when all of them are empty (all backends compute empty rows and mask them).
- Empty rows are zero for backends that compute every row (0 x garbage could be NaN). For a backend
  registered ``routed_rows_only`` (the mega kernels: ``kernels/moe/__init__.py``) they are left as
  allocated in the send buffer, the expert outputs and both gradients: at the default capacity half
  of every buffer, whose writes the step then saves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from kernels.moe import BackendArgs, MoEBackend


def static_capacity(num_tokens: int, top_k: int, ep: int, num_local_experts: int, capacity_factor: float) -> int:
    """C: the rows each rank sends every peer per all-to-all (the module docstring's formula, at least
    one row so that every buffer has a shape); bench/comm_volume.py counts bytes with it."""
    most_possible = num_tokens * min(top_k, num_local_experts)
    return max(1, min(math.ceil(capacity_factor * num_tokens * top_k / ep), most_possible))


def local_expert_ids(expert_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """The id global expert e has on the rank that owns it: e - r x (E/ep) for owner r = e // (E/ep)."""
    return expert_ids % num_local_experts


class _Layout(NamedTuple):
    """One chunk's static-capacity send layout (:meth:`ExpertParallel._dispatch`), kept for its combine."""

    sorted_slots_N: torch.Tensor  # the (token, k) slots in expert order
    sorted_ids_N: torch.Tensor  # their expert ids
    keep_N: torch.Tensor  # False where the slot did not fit its destination's C rows (expert order)
    send_row_N: torch.Tensor  # the slot's row in the send buffer, expert order (``trash`` if dropped)
    slot_row_TK: torch.Tensor  # the same per slot in (token, k) order
    row_slot_R: torch.Tensor  # per send-buffer row: the slot it carries, -1 for an empty row
    trash: int  # ep x C = R: the rows of the send buffer


class _GatherSlotRows(torch.autograd.Function):
    """``x_TD[row_token_R]``: the send buffer's rows from their tokens. Its backward sums each token's
    K rows by a gather over ``slot_row_TK`` in float32 (at least), where autograd's own would
    scatter-add the R rows into T (bf16 atomics, every empty row on token 0)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, row_token_R: torch.Tensor, slot_row_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_row_TK)
        return x_TD[row_token_R]

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (slot_row_TK,) = ctx.saved_tensors
        return _sum_slot_rows(grad_RD, slot_row_TK).to(grad_RD.dtype), None, None


def _undefined_rows(num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """A (num_rows, D) buffer in ``like``'s dtype, left as allocated: only the rows of slots are
    written, for backends that read no other (the tests fill it with NaN instead)."""
    return like.new_empty((num_rows, like.shape[-1]))


def _scatter_slot_rows(vals: torch.Tensor, slot_row_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows, D) in ``vals``' dtype: row ``slot_row_TK[t, k]`` holds ``vals[t, k]`` ((T, K, D), or
    (T, 1, D) for one row per token), dropped slots land in a spare row past the end and go with it,
    and every other row is left undefined (:func:`_undefined_rows`)."""
    buf_RD = _undefined_rows(num_rows + 1, vals)
    buf_RD[slot_row_TK] = vals
    return buf_RD[:num_rows]


class _ScatterSlotRows(_GatherSlotRows):
    """The send buffer for a ``routed_rows_only`` backend: each slot's token row written to its row
    (dropped slots to a spare row past R), the empty rows left undefined; R - T x K fewer rows written
    than :class:`_GatherSlotRows`, whose backward it inherits."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, slot_row_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
        ctx.save_for_backward(slot_row_TK)
        return _scatter_slot_rows(x_TD.unsqueeze(1), slot_row_TK, num_rows)


class _CombineSlotRows(torch.autograd.Function):
    """y_TD = sum over k of w_TK x ``y_RD[slot_row_TK]`` (dropped slots add nothing), in float32 (at
    least). Its backward writes each row's gradient from its slot (a gather over ``row_slot_R``), where
    autograd's own would scatter-add T x K rows into R. With ``empty_undefined`` (a ``routed_rows_only``
    backend) the gradient is scattered from the slots instead, its empty rows left undefined."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, w_TK: torch.Tensor, slot_row_TK: torch.Tensor, row_slot_R: torch.Tensor,
                dtype: torch.dtype, empty_undefined: bool) -> torch.Tensor:
        ctx.save_for_backward(y_RD, w_TK, slot_row_TK, row_slot_R)
        ctx.empty_undefined = empty_undefined
        y_TD = _sum_slot_rows(y_RD, slot_row_TK, w_TK)
        # No .to() when the dtype already matches: torch 2.11 compiles a Function whose output is
        # such a no-op cast with zero gradients.
        return y_TD if y_TD.dtype == dtype else y_TD.to(dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, w_TK, slot_row_TK, row_slot_R = ctx.saved_tensors
        K, acc = w_TK.shape[1], _acc(y_RD.dtype)
        grad_w_TK = None
        if ctx.needs_input_grad[1]:
            grad_w_TK = (_slot_outputs(y_RD, slot_row_TK) * grad_TD.to(acc).unsqueeze(1)).sum(dim=-1).to(w_TK.dtype)
        grad_y_RD = None
        if ctx.needs_input_grad[0] and ctx.empty_undefined:
            grad_TKD = (grad_TD.to(acc).unsqueeze(1) * w_TK.to(acc).unsqueeze(-1)).to(y_RD.dtype)
            grad_y_RD = _scatter_slot_rows(grad_TKD, slot_row_TK, y_RD.shape[0])
        elif ctx.needs_input_grad[0]:
            real_R = row_slot_R >= 0
            slot_R = row_slot_R.clamp(min=0)
            scaled_RD = grad_TD[slot_R // K].to(acc) * w_TK.reshape(-1)[slot_R].to(acc).unsqueeze(-1)
            grad_y_RD = torch.where(real_R.unsqueeze(-1), scaled_RD, 0.0).to(y_RD.dtype)
        return grad_y_RD, grad_w_TK, None, None, None, None


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The sums' dtype: float32, or the inputs' where wider."""
    return torch.promote_types(dtype, torch.float32)


def _sum_slot_rows(y_RD: torch.Tensor, slot_row_TK: torch.Tensor, w_TK: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D) in :func:`_acc`'s dtype: sum over k of each slot's row of ``y_RD`` (times ``w_TK``),
    dropped slots (row R) adding nothing. Written as K gathers added in k order rather than a
    reduction over a (T, K, D) gather: inductor then makes one pointwise kernel whose loads run
    along D, where its reduction over the middle dim read rows at a fraction of the memory rate."""
    R, acc = y_RD.shape[0], _acc(y_RD.dtype)
    out_TD = None
    for k in range(slot_row_TK.shape[1]):
        row_T = slot_row_TK[:, k]
        term_TD = torch.where((row_T < R).unsqueeze(-1), y_RD[row_T.clamp(max=R - 1)].to(acc), 0.0)
        if w_TK is not None:
            term_TD = term_TD * w_TK[:, k].to(acc).unsqueeze(-1)
        out_TD = term_TD if out_TD is None else out_TD + term_TD
    return out_TD


def _slot_outputs(y_RD: torch.Tensor, slot_row_TK: torch.Tensor) -> torch.Tensor:
    """(T, K, D) in :func:`_acc`'s dtype: each slot's row of ``y_RD`` (an output, or a gradient of the
    send buffer), zero where the slot was dropped (row R)."""
    R = y_RD.shape[0]
    out_TKD = y_RD[slot_row_TK.clamp(max=R - 1)].to(_acc(y_RD.dtype))
    return torch.where((slot_row_TK < R).unsqueeze(-1), out_TKD, 0.0)


class ExpertParallel:
    """The experts' dispatch (``models/moe/moe.py``, ``ExpertDispatch``) under expert parallelism:
    weights cast from this rank's shard and gathered over the ranks that share its experts, tokens
    carried to the ranks owning their experts and back (the module docstring)."""

    def __init__(self, mesh: DeviceMesh, num_experts: int, capacity_factor: float, param_dtype: torch.dtype,
                 chunks: int = 1):
        self.ep_mesh = mesh["ep"]
        self.shard_mesh = mesh["dp_shard_mod_ep"]
        self.ep = self.ep_mesh.size()
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.param_dtype = param_dtype
        self.chunks = chunks

    def cast(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's shards of the sharded parameters in the compute dtype (no compute copies)."""
        return tuple(w.to_local().to(self.param_dtype) for w in weights)

    def gather(self, *local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's experts whole, (E/ep, ...), from its shards of them (identity without
        expert-FSDP sharding)."""
        if self.shard_mesh.size() > 1:
            return tuple(funcol.all_gather_tensor_autograd(w, 1, self.shard_mesh) for w in local)
        return local

    def capacity(self, num_tokens: int, top_k: int) -> int:
        return static_capacity(num_tokens, top_k, self.ep, self.num_local_experts, self.capacity_factor)

    def chunk_sizes(self, num_tokens: int) -> list[int]:
        """Token counts of the chunks: min(chunks, T) of them (one if T = 0), differing by at most
        one (the first T mod n one larger). Python ints: T is static for a compiled graph."""
        n = max(1, min(self.chunks, num_tokens))
        return [num_tokens // n + (i < num_tokens % n) for i in range(n)]

    def __call__(self, backend: MoEBackend, args: BackendArgs, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, w1_local: torch.Tensor, w3_local: torch.Tensor, w2_local: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, dropped_E): the combined output and the slots per expert that did not fit."""
        empty_undefined = backend.routed_rows_only
        if empty_undefined:
            args = dataclasses.replace(args, write_empty_rows=False)
        sizes = self.chunk_sizes(x_TD.shape[0])
        if len(sizes) == 1:  # no split views: P = 1 runs exactly the unchunked graph
            chunks = [(x_TD, topk_ids_TK, topk_weights_TK)]
        else:
            chunks = list(zip(x_TD.split(sizes), topk_ids_TK.split(sizes), topk_weights_TK.split(sizes)))

        # Every chunk's dispatch is issued before any expert compute, so later chunks' rows can be
        # in flight while the first chunk's GEMMs run; the combine of each chunk is issued as soon
        # as its GEMMs are done, and read only after the last chunk's (when the waits are deferred:
        # in eager, not in a default compile -- see the module docstring).
        sent = [self._dispatch(x, ids, empty_undefined) for x, ids, _ in chunks]
        backs = []
        for recv_x, recv_expert, _ in sent:
            ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x_TD.device)
            y_recv = backend(recv_x, recv_expert.view(-1, 1), ones, w1_local, w3_local, w2_local, args)
            backs.append(funcol.all_to_all_single_autograd(y_recv, None, None, self.ep_mesh))
        outs = [self._combine(y_back, layout, weights, x_TD.dtype, empty_undefined)
                for y_back, (_, _, layout), (_, _, weights) in zip(backs, sent, chunks)]
        if len(outs) == 1:
            return outs[0]
        y_TD = torch.cat([y for y, _ in outs])
        dropped_E = torch.stack([d for _, d in outs]).sum(dim=0)
        return y_TD, dropped_E

    def _dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, empty_undefined: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, _Layout]:
        """Lays out one chunk's slots in a static-capacity send buffer and issues its all-to-alls.
        Returns (recv_x, recv_expert, layout): the rows this rank's experts receive (waited on at
        first use), their local expert ids (-1 = empty row: zero, or undefined if ``empty_undefined``),
        and the layout for :meth:`_combine`."""
        T, K = topk_ids_TK.shape
        ep, n_local = self.ep, self.num_local_experts
        C = self.capacity(T, K)
        device = x_TD.device

        # Dispatch layout: slots sorted by expert are also sorted by destination rank; a slot's row
        # in the send buffer is dest * C + (its position among the slots going to dest).
        ids_N = topk_ids_TK.reshape(-1)
        sorted_slots_N = torch.argsort(ids_N, stable=True)
        sorted_ids_N = ids_N[sorted_slots_N]
        dest_N = sorted_ids_N // n_local
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        counts_E = counts_E.scatter_add(0, ids_N, torch.ones_like(ids_N))
        per_dest = counts_E.view(ep, n_local).sum(dim=1)
        dest_start = torch.cumsum(per_dest, 0) - per_dest
        pos_N = torch.arange(ids_N.numel(), device=device) - dest_start[dest_N]
        keep_N = pos_N < C
        trash = ep * C  # one extra row absorbs the writes of dropped slots
        send_row_N = torch.where(keep_N, dest_N * C + pos_N, trash)

        # Per send-buffer row: the slot it carries and the receiving rank's local expert id (-1 for
        # an empty row, which carries token 0's values or nothing defined, ignored on arrival).
        row_slot_R = torch.full((trash + 1,), -1, dtype=torch.int64, device=device)
        row_slot_R = row_slot_R.scatter(0, send_row_N, sorted_slots_N)[:trash]
        row_expert = torch.full((trash + 1,), -1, dtype=torch.int64, device=device)
        row_expert = row_expert.scatter(0, send_row_N, local_expert_ids(sorted_ids_N, n_local))[:trash]
        slot_row_TK = torch.empty_like(send_row_N).scatter(0, sorted_slots_N, send_row_N).view(T, K)
        if empty_undefined:
            send_x = _ScatterSlotRows.apply(x_TD, slot_row_TK, trash)
        else:
            send_x = _GatherSlotRows.apply(x_TD, row_slot_R.clamp(min=0) // K, slot_row_TK)

        recv_x = funcol.all_to_all_single_autograd(send_x, None, None, self.ep_mesh)
        recv_expert = funcol.all_to_all_single(row_expert, None, None, self.ep_mesh)
        layout = _Layout(sorted_slots_N, sorted_ids_N, keep_N, send_row_N, slot_row_TK, row_slot_R, trash)
        return recv_x, recv_expert, layout

    def _combine(self, y_back: torch.Tensor, layout: _Layout, topk_weights_TK: torch.Tensor, dtype: torch.dtype,
                 empty_undefined: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's output from the rows its experts sent back: each slot reads its row (slot
        order), masked where dropped, weighted, summed over k. Returns (y_TD, dropped_E)."""
        y_TD = _CombineSlotRows.apply(y_back, topk_weights_TK, layout.slot_row_TK, layout.row_slot_R, dtype,
                                      empty_undefined)
        dropped_E = torch.zeros(self.num_experts, dtype=torch.float32, device=y_back.device)
        dropped_E = dropped_E.scatter_add(0, layout.sorted_ids_N, (~layout.keep_N).float())
        return y_TD, dropped_E


def apply_ep(model: torch.nn.Module, mesh: DeviceMesh, capacity_factor: float, param_dtype: torch.dtype,
             chunks: int = 1) -> None:
    """Shard every layer's expert weights over the mesh (see the module docstring) and route its
    tokens through :class:`ExpertParallel`, in ``chunks`` pipelined chunks per layer. Call on the
    meta-device model, before FSDP."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shard = mesh["dp_shard_mod_ep"].size()
    for block in model.layers.values():
        experts = block.moe.experts
        for name in ("w1", "w2", "w3"):
            param = getattr(experts, name)
            if param.shape[1] % shard:
                raise ValueError(f"expert weight {name} {tuple(param.shape)}: dim 1 is not divisible by the "
                                 f"{shard} ranks that shard each expert group (dp_shard / ep)")
            dtensor = distribute_tensor(param, mesh, [Replicate(), Shard(1), Shard(0)])
            experts.register_parameter(name, torch.nn.Parameter(dtensor))
        experts.parallelize(ExpertParallel(mesh, experts.num_experts, capacity_factor, param_dtype, chunks))


def expert_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for block in model.layers.values() if isinstance(block.moe.experts.dispatch, ExpertParallel)
            for p in block.moe.experts.parameters()}


@torch.no_grad()
def finish_expert_grads(model: torch.nn.Module, mesh: DeviceMesh, dp_size: int) -> None:
    """After backward: sum expert gradients over the replicas (HSDP) and turn the sums into the mean
    over data-parallel ranks, like FSDP does for every other parameter.

    By now each shard's gradient holds the contributions of the tokens of its whole EP group (the
    all-to-all backward) and of the ranks that share the shard (the all-gather's reduce-scatter).
    """
    experts = expert_params(model)
    # Model order, the same on every rank (a set's order follows object ids, which differ between processes).
    grads = [p.grad.to_local() for p in model.parameters() if p in experts and p.grad is not None]
    if not grads:
        return
    if mesh["dp_replicate"].size() > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=mesh["dp_replicate"].get_group())
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
    torch._foreach_div_(grads, float(dp_size))
