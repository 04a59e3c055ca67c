"""The ``grouped_mm`` MoE backend: TorchTitan's method, in plain PyTorch ops.

Dispatch: sort the T*K (token, k) slots by expert and gather their rows of x (N x D, a copy).
Experts: ``torch._grouped_mm`` for gate, up and down with per-expert row offsets, SwiGLU between.
Combine: put the rows back in (token, k) order, weight them in float32 and sum over k.

Every shape is static (no ``.item()``, no data-dependent sizes), so it compiles with
``fullgraph=True``. Where ``_grouped_mm`` has no kernel (an older torch on CPU, float32 on CUDA) a
loop over the experts stands in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common.routing import sort_by_expert
from kernels.moe import register_moe_backend


def _probe_cpu_grouped_mm() -> bool:
    try:  # 8 bf16 columns: the CPU kernel wants 16-byte strides
        a, b = torch.ones(8, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, b, offs=torch.tensor([8], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


# Probed once at import, so that torch.compile sees a constant rather than tracing the probe.
_CPU_HAS_GROUPED_MM = _probe_cpu_grouped_mm()


def _aligned16(*tensors: torch.Tensor) -> bool:
    return all(stride == 1 or stride * t.element_size() % 16 == 0 for t in tensors for stride in t.stride())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` with offsets, in its two layouts.

    (N, K) x (E, K, M) -> (N, M): rows [offs[e-1], offs[e]) of a times b[e].
    (M, N) x (N, K) -> (E, M, K): columns [offs[e-1], offs[e]) of a times those rows of b (a
    weight gradient: the groups split the reduction dim).

    ``torch._grouped_mm`` where it runs: bf16 on CUDA, and bf16 on CPU where this torch has a
    kernel and the strides are multiples of 16 bytes (its meta function, which torch.compile
    traces with, accepts bf16 only). Otherwise (float32, e.g. the debug config; CPU on an older
    torch) a loop over the experts that reads the offsets on the host: correct but slow.
    """
    if a.dtype == torch.bfloat16 and (a.is_cuda or (_CPU_HAS_GROUPED_MM and _aligned16(a, b))):
        return torch._grouped_mm(a, b, offs=offs_E)
    if torch.compiler.is_compiling():
        return _grouped_mm_dense(a, b, offs_E)
    ends = offs_E.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 2:
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, ends))])


def _grouped_mm_dense(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm`'s fallback when traced: every group's product over all rows (or columns),
    then a mask keeps each row's own group. E times the FLOPs, but no host read of the offsets:
    slicing at data-dependent offsets traces, yet inductor cannot lower the backward's
    slice_scatter on such sizes (GuardOnDataDependentSymNode; seen with EP on CPU in float32)."""
    E = offs_E.shape[0]
    idx = torch.arange(a.shape[0] if b.dim() == 3 else a.shape[1], device=a.device, dtype=offs_E.dtype)
    # group of each row (column): the first e with idx < offs[e]; rows past offs[-1] belong to none.
    group_N = torch.searchsorted(offs_E, idx, right=True)
    mask_EN = (group_N.unsqueeze(0) == torch.arange(E, device=a.device).unsqueeze(1)).to(a.dtype)
    if b.dim() == 2:  # (M, N) x (N, K) -> (E, M, K), the groups split N
        return torch.einsum("mn,en,nk->emk", a, mask_EN, b)
    return torch.einsum("en,enm->nm", mask_EN, torch.matmul(a.unsqueeze(0), b))


def combine(out_RD: torch.Tensor, row_of_slot_N: torch.Tensor, topk_ids_TK: torch.Tensor,
            topk_weights_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum_k topk_weights[t, k] * out[row_of_slot[t*K + k]], in ``dtype``.

    A gather back to (token, k) order, then a deterministic float32 weighted sum over k (no
    scatter-add atomics). Empty slots (id -1) are masked, whatever row they point at.
    """
    T, K = topk_ids_TK.shape
    out_TKD = out_RD[row_of_slot_N].view(T, K, -1).float()
    out_TKD = torch.where((topk_ids_TK >= 0).unsqueeze(-1), out_TKD, 0.0)
    return (out_TKD * topk_weights_TK.float().unsqueeze(-1)).sum(dim=1).to(dtype)


def route_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) int64 slot order sorted by expert (stable) and (E,) int32 cumulative row ends per expert:
    :func:`~kernels.common.routing.sort_by_expert` with its offsets in ``torch._grouped_mm``'s form.

    Empty slots (id -1) sort last and are counted into the last expert's group: they are computed
    and then masked. That costs their FLOPs, but keeps every row inside a group, because
    ``_grouped_mm`` leaves rows past the last offset undefined (in its output and in the input
    gradient) and, on CPU, returns only ``offs[-1]`` rows.
    """
    sorted_slot_N, offsets_E1 = sort_by_expert(topk_ids_TK, num_experts)
    N = sorted_slot_N.numel()
    offs_E = torch.cat([offsets_E1[1:-1], offsets_E1.new_full((1,), N)])  # ... into the last expert's group
    return sorted_slot_N.long(), offs_E


@register_moe_backend("grouped_mm")
def moe_grouped_mm(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    K = topk_ids_TK.shape[1]
    sorted_slots_N, offs_E = route_by_expert(topk_ids_TK, w1_EFD.shape[0])
    x_ND = x_TD[sorted_slots_N // K]
    gate_NF = grouped_mm(x_ND, w1_EFD.transpose(-2, -1), offs_E)
    up_NF = grouped_mm(x_ND, w3_EFD.transpose(-2, -1), offs_E)
    out_ND = grouped_mm(F.silu(gate_NF) * up_NF, w2_EDF.transpose(-2, -1), offs_E)
    return combine(out_ND, torch.argsort(sorted_slots_N), topk_ids_TK, topk_weights_TK, x_TD.dtype)
