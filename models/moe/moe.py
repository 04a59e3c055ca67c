"""The MoE block of Qwen3: router -> routed experts (a swappable backend) -> combined output.

Dispatch (grouping the (token, k) slots by expert), the expert SwiGLU GEMMs and the weighted
combine all happen inside the backend chosen by ``[moe] backend`` (see ``kernels/moe/__init__.py``):
``torch`` (the reference loop), ``grouped_mm`` (TorchTitan's method) or ``mega`` (fused Triton).
Qwen3 has no shared experts.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from kernels.moe import get_moe_backend
from models.moe.router import TokenChoiceTopKRouter


class GroupedExperts(nn.Module):
    """E SwiGLU experts in TorchTitan's layout: w1, w3 (E, F, D) and w2 (E, D, F).

    With expert parallelism (``parallelisms/expert_parallel.py``) the weights are DTensors sharded
    on the expert dim and ``expert_parallel`` carries tokens to the ranks owning their experts. Its
    one-process proxy (``parallelisms/ep_proxy.py``) leaves E/P experts' weights and folds the slots
    of all ``num_experts`` onto them.

    ``compute_weights``, when the trainer sets it (``components/compute_weights.py``), replaces the
    per-call bf16 cast / FP8 quantization of the weights with copies made once per optimizer step:
    its ``weights(self)`` returns this rank's (w1, w3, w2) in compute form and its
    ``backend_kwargs()`` what the backend takes besides (the FP8 op's pre-quantized weights).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, backend: str):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.backend_name = backend
        self.backend = get_moe_backend(backend)
        self.expert_parallel = None
        self.compute_weights = None  # set by the trainer, after init (see the class docstring)

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, dropped_E): dropped_E counts slots that did not fit expert parallelism's
        static buffers (always zero without EP)."""
        backend, copies = self.backend, self.compute_weights
        if copies is not None:
            # This rank's weights in compute form, made once per optimizer step.
            w1_EFD, w3_EFD, w2_EDF = copies.weights(self)
            if kwargs := copies.backend_kwargs():
                backend = functools.partial(backend, **kwargs)
            if self.expert_parallel is not None:
                w1_EFD, w3_EFD, w2_EDF = (self.expert_parallel.gather_shards(w) for w in (w1_EFD, w3_EFD, w2_EDF))
        elif self.expert_parallel is not None:
            w1_EFD, w3_EFD, w2_EDF = (self.expert_parallel.gather_weight(w) for w in (self.w1, self.w3, self.w2))
        else:
            w1_EFD, w3_EFD, w2_EDF = self.w1, self.w3, self.w2
        if torch.is_autocast_enabled(x_TD.device.type):
            # Autocast does not see through custom kernels: hand every backend the compute dtype
            # (compute copies are in it already).
            dtype = torch.get_autocast_dtype(x_TD.device.type)
            x_TD = x_TD.to(dtype)
            if copies is None:
                w1_EFD, w2_EDF, w3_EFD = w1_EFD.to(dtype), w2_EDF.to(dtype), w3_EFD.to(dtype)
        if self.expert_parallel is not None:
            return self.expert_parallel(backend, x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF)
        dropped_E = torch.zeros(self.num_experts, dtype=torch.float32, device=x_TD.device)
        return backend(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF), dropped_E

    def reset_parameters(self, init_std: float, out_init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=out_init_std)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_init_std)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 backend: str, use_expert_bias: bool):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, norm_topk_prob, use_expert_bias)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, backend)

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
