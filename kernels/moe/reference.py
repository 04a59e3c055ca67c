"""The ``torch`` MoE backend: a plain PyTorch loop over experts.

It is the readable statement of what every other backend computes and the numerical oracle their
tests compare against. It is not fast (one small GEMM per expert, data-dependent shapes) and it does
not compile with ``fullgraph=True``; use ``grouped_mm`` or ``mega`` for training at scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe import register_moe_backend


@register_moe_backend("torch")
def moe_reference(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_k s[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])) with e = topk_ids[t,k].

    Slots with id -1 are empty and contribute nothing. Computes in the dtype of ``x_TD`` (pass float64 inputs for an exact oracle); the weighted sum
    over k is accumulated in float32 or better and cast back to ``x_TD.dtype``.
    """
    num_experts = w1_EFD.shape[0]
    acc_dtype = torch.promote_types(x_TD.dtype, torch.float32)
    y_TD = torch.zeros(x_TD.shape, dtype=acc_dtype, device=x_TD.device)
    for e in range(num_experts):
        # No skip for an expert without rows: its empty products keep y connected to x and the
        # weights, so a rank that receives no rows under expert parallelism still runs the backward
        # all-to-all like its peers (a skip made the ranks fall out of step).
        token_idx, k_idx = torch.where(topk_ids_TK == e)
        x_eD = x_TD[token_idx]
        h_eF = F.silu(x_eD @ w1_EFD[e].t()) * (x_eD @ w3_EFD[e].t())
        out_eD = h_eF @ w2_EDF[e].t()
        s_e1 = topk_weights_TK[token_idx, k_idx].unsqueeze(-1)
        y_TD = y_TD.index_add(0, token_idx, out_eD.to(acc_dtype) * s_e1.to(acc_dtype))
    return y_TD.to(x_TD.dtype)
