"""Expert parallelism: each EP rank owns E/ep experts; tokens travel to the rank of their expert and
back with all-to-all, autograd-correct, with no device-to-host sync.

TorchTitan exchanges the split sizes and reads them on the host in every MoE layer. Here the
buffers have a static capacity instead: each rank sends every peer exactly C rows,

    C = min(ceil(capacity_factor x T x K / ep), T x min(K, E / ep))

of which the first ``count`` are real (token, k) slots and the rest are empty (expert id -1, which
every backend skips). Slots beyond C are dropped *and counted*: the trainer reads the count with the
loss at the end of the step and stops before the optimizer applies an update computed without them
(raise ``[parallelism] expert_capacity_factor``; a factor >= ep can never overflow).

Expert weights are DTensors on the (dp_replicate, dp_shard_mod_ep, ep) mesh: experts split over
``ep`` (Shard(0)), and within an EP rank's experts dim 1 (F for w1/w3, D for w2) split over
``dp_shard_mod_ep`` (Shard(1)) -- FSDP's memory saving, done here rather than by a nested FSDP unit
because FSDP's hooks on a submodule break a ``fullgraph`` compile of the block. The forward
all-gathers the shard (in the compute dtype) with an autograd-aware collective whose backward is
the reduce-scatter; :func:`finish_expert_grads` completes the reduction after backward.

On the receiving rank the rows go straight into the MoE backend with their local expert ids as
K = 1 routing; the backend groups them by expert itself (``mega`` gathers rows by index inside its
GEMM, so no extra copy of the received rows is made). Routing weights are applied back on the
source rank, in float32, when the k outputs of a token are summed, so the router's gradient never
crosses the network.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


class ExpertParallel:
    def __init__(self, mesh: DeviceMesh, num_experts: int, capacity_factor: float, param_dtype: torch.dtype):
        self.ep_mesh = mesh["ep"]
        self.shard_mesh = mesh["dp_shard_mod_ep"]
        self.ep = self.ep_mesh.size()
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.param_dtype = param_dtype

    def gather_weight(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's experts, whole: (E/ep, ...) in the compute dtype, from the sharded parameter."""
        local = w.to_local().to(self.param_dtype)
        if self.shard_mesh.size() > 1:
            local = funcol.all_gather_tensor_autograd(local, 1, self.shard_mesh)
        return local

    def capacity(self, num_tokens: int, top_k: int) -> int:
        most_possible = num_tokens * min(top_k, self.num_local_experts)
        return max(1, min(math.ceil(self.capacity_factor * num_tokens * top_k / self.ep), most_possible))

    def __call__(self, backend, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 w1_local: torch.Tensor, w3_local: torch.Tensor, w2_local: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, dropped_E): the combined output and the slots per expert that did not fit."""
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
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

        # Per send-buffer row: the token it carries (clamped to 0 for empty rows, whose content is
        # ignored on arrival) and the receiving rank's local expert id (-1 = empty).
        row_token = torch.full((trash + 1,), -1, dtype=torch.int64, device=device)
        row_token = row_token.scatter(0, send_row_N, sorted_slots_N // K)[:trash]
        row_expert = torch.full((trash + 1,), -1, dtype=torch.int64, device=device)
        row_expert = row_expert.scatter(0, send_row_N, sorted_ids_N % n_local)[:trash]
        send_x = x_TD[row_token.clamp(min=0)]

        recv_x = funcol.all_to_all_single_autograd(send_x, None, None, self.ep_mesh)
        recv_expert = funcol.all_to_all_single(row_expert, None, None, self.ep_mesh)
        ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=device)
        y_recv = backend(recv_x, recv_expert.view(-1, 1), ones, w1_local, w3_local, w2_local)
        y_back = funcol.all_to_all_single_autograd(y_recv, None, None, self.ep_mesh)

        # Combine: each slot reads its row back (slot order), masked where dropped, weighted, summed.
        slot_row_N = torch.empty_like(send_row_N).scatter(0, sorted_slots_N, send_row_N)
        slot_keep_N = torch.empty_like(keep_N).scatter(0, sorted_slots_N, keep_N)
        out_TKD = y_back[slot_row_N.clamp(max=trash - 1)].view(T, K, D).float()
        out_TKD = torch.where(slot_keep_N.view(T, K, 1), out_TKD, 0.0)
        y_TD = (out_TKD * topk_weights_TK.float().unsqueeze(-1)).sum(dim=1).to(x_TD.dtype)
        dropped_E = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        dropped_E = dropped_E.scatter_add(0, sorted_ids_N, (~keep_N).float())
        return y_TD, dropped_E


def apply_ep(model: torch.nn.Module, mesh: DeviceMesh, capacity_factor: float, param_dtype: torch.dtype) -> None:
    """Shard every layer's expert weights over the mesh (see the module docstring) and route its
    tokens through :class:`ExpertParallel`. Call on the meta-device model, before FSDP."""
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
        experts.expert_parallel = ExpertParallel(mesh, experts.num_experts, capacity_factor, param_dtype)


def expert_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for block in model.layers.values() if block.moe.experts.expert_parallel is not None
            for p in block.moe.experts.parameters()}


@torch.no_grad()
def finish_expert_grads(model: torch.nn.Module, mesh: DeviceMesh, dp_size: int) -> None:
    """After backward: sum expert gradients over the replicas (HSDP) and turn the sums into the mean
    over data-parallel ranks, like FSDP does for every other parameter.

    By now each shard's gradient holds the contributions of the tokens of its whole EP group (the
    all-to-all backward) and of the ranks that share the shard (the all-gather's reduce-scatter).
    """
    grads = [p.grad.to_local() for p in expert_params(model) if p.grad is not None]
    if not grads:
        return
    if mesh["dp_replicate"].size() > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=mesh["dp_replicate"].get_group())
        torch._foreach_copy_(grads, list(flat.split([g.numel() for g in grads])))
    torch._foreach_div_(grads, float(dp_size))
