"""The MoE block of Qwen3: router -> routed experts (a swappable backend) -> combined output.

Dispatch (grouping the (token, k) slots by expert), the expert SwiGLU GEMMs and the weighted
combine all happen inside the backend chosen by ``[moe] backend`` (see ``kernels/moe/__init__.py``):
``torch`` (the reference loop), ``grouped_mm`` (TorchTitan's method) or ``mega`` (fused Triton).
Qwen3 has no shared experts.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn

from kernels.moe import BackendArgs, MoEBackend, get_moe_backend
from models.moe.router import TokenChoiceTopKRouter


class ExpertDispatch(Protocol):
    """How a layer's tokens reach its experts and how the weights the experts compute with are made:
    :class:`LocalDispatch` here, or ``parallelisms/expert_parallel.py``'s ``ExpertParallel``."""

    def cast(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's parameters in the compute dtype (when there are no compute copies)."""

    def gather(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The experts this rank computes, whole, from its compute-form weights."""

    def __call__(self, backend: MoEBackend, args: BackendArgs, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_TD, dropped_E): the combined output and the slots per expert that did not fit."""


class LocalDispatch:
    """Every expert on this rank: the backend sees the layer's tokens as routed, nothing is dropped."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def cast(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Autocast does not see through custom kernels: the backend gets the weights in its dtype.
        if torch.is_autocast_enabled(weights[0].device.type):
            dtype = torch.get_autocast_dtype(weights[0].device.type)
            return tuple(w.to(dtype) for w in weights)
        return weights

    def gather(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return weights

    def __call__(self, backend, args, x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF):
        y_TD = backend(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, args)
        return y_TD, torch.zeros(self.num_experts, dtype=torch.float32, device=x_TD.device)


class GroupedExperts(nn.Module):
    """E SwiGLU experts in TorchTitan's layout: w1, w3 (E, F, D) and w2 (E, D, F).

    What computes them is fixed before the first forward, at three seams:

    - ``backend`` and ``args``: the registered function named by ``[moe] backend`` and the frozen
      :class:`~kernels.moe.BackendArgs` it takes beyond the six tensors; given at construction.
    - ``dispatch``: how the tokens reach the experts and how the weights are made whole
      (:class:`ExpertDispatch`): :class:`LocalDispatch`, or expert parallelism's all-to-all and
      weight gather, installed by ``parallelisms/expert_parallel.py`` (:meth:`parallelize`).
    - ``copies``: this rank's weights in compute form (bf16, or the e4m3 copies the FP8 backend
      reads through ``args.quantized``), made once per optimizer step by the precision step
      (``components/precision``, :meth:`use_compute_copies`); None: the parameters, cast on every
      call by the dispatch.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, backend: str,
                 args: BackendArgs = BackendArgs()):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.backend = get_moe_backend(backend)
        self.backend.check(args)
        self.args = args
        self.dispatch: ExpertDispatch = LocalDispatch(num_experts)
        self.copies: nn.Module | None = None

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, dropped_E): dropped_E counts slots that did not fit expert parallelism's
        static buffers (always zero without EP)."""
        if torch.is_autocast_enabled(x_TD.device.type):
            # Autocast does not see through custom kernels: hand every backend the compute dtype.
            x_TD = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        if self.copies is not None:
            local = self.copies.weights(self)
        else:
            local = self.dispatch.cast(self.w1, self.w3, self.w2)
        w1_EFD, w3_EFD, w2_EDF = self.dispatch.gather(*local)
        return self.dispatch(self.backend, self.args, x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)

    def parallelize(self, dispatch: ExpertDispatch) -> None:
        """Install the dispatch of a parallel layout (on the meta-device model, before compile)."""
        self.dispatch = dispatch

    def use_compute_copies(self, copies: nn.Module, args: BackendArgs) -> None:
        """Compute with ``copies`` (a module whose ``weights(self)`` gives this rank's (w1, w3, w2) in
        compute form) and the backend arguments that go with them (the precision step, last before
        the first forward)."""
        self.backend.check(args)
        self.copies, self.args = copies, args

    def reset_parameters(self, init_std: float, out_init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=out_init_std)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_init_std)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 backend: str, use_expert_bias: bool, backend_args: BackendArgs = BackendArgs()):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, norm_topk_prob, use_expert_bias)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, backend, backend_args)

    def forward(self, x_BLD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_BLD, router_stats_3E): row 0 the routed-slot counts per expert (no gradient),
        row 1 the summed router probabilities (for the auxiliary loss), row 2 the slots dropped by
        expert parallelism's capacity (the trainer logs them, or stops: ``expert_capacity_overflow``)."""
        return self.run_experts(x_BLD.shape, *self.route(x_BLD))

    def route(self, x_BLD: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_TD, topk_ids_TK, topk_weights_TK, tokens_per_expert_E, probs_sum_E): the router's part."""
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        return (x_TD, *self.router(x_TD))

    def run_experts(self, shape_BLD: torch.Size, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                    topk_weights_TK: torch.Tensor, tokens_per_expert_E: torch.Tensor, probs_sum_E: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' part, from :meth:`route`'s outputs: (y_BLD, router_stats_3E) as :meth:`forward`."""
        y_TD, dropped_E = self.experts(x_TD, topk_ids_TK, topk_weights_TK)
        return y_TD.reshape(shape_BLD), torch.stack([tokens_per_expert_E, probs_sum_E, dropped_E.detach()])

    def reset_parameters(self, init_std: float, out_init_std: float) -> None:
        self.router.reset_parameters(init_std)
        self.experts.reset_parameters(init_std, out_init_std)


def depth_init_std(layer_id: int, base_std: float = 0.02) -> float:
    """Output projections shrink with depth so the residual stream's variance stays bounded."""
    return base_std / math.sqrt(2 * (layer_id + 1))
