"""The ``grouped_mm_fp8`` MoE backend: ``grouped_mm`` with TorchTitan's FP8 expert GEMMs.

``[moe] backend = "grouped_mm"`` with ``[precision] moe = "fp8_rowwise"``. The method of
TorchTitan 0.2.2 + torchao (``torchao.prototype.moe_training``), written here in plain PyTorch:
each of the three expert GEMMs (gate, up, down) is ``out = a @ w[e]^T`` over per-expert row groups
and runs forward and backward as rowwise-scaled e4m3 ``torch._scaled_grouped_mm``:

    forward  out = a w^T : a (P, K) rowwise over K; w (E, N, K) rowwise over K (a scale per (e, n))
    dgrad    da = dout w : dout (P, N) rowwise over N; w^T (E, K, N) rowwise over N (per (e, k))
    wgrad    dw = dout^T a (per expert): dout and a both quantized along the tokens, one scale per
             (expert, column): ``_scaled_grouped_mm`` with both operands 2D and the groups
             splitting the reduction dim

Scales and rounding as in :mod:`kernels.fp8.rowwise` (power-of-two scales, e4m3 everywhere,
fast accumulation in all three GEMMs as torchao does here). Saved for backward: the bf16 inputs.

Dispatch differs from ``grouped_mm`` the way TorchTitan's FP8 path differs from its bf16 one:
each expert's row group is padded with zero rows to a multiple of 16, and to at least 16. The FP8
GEMMs need it: the wgrad reads each group's rows as its reduction dim, whose start must be 16-byte
aligned, and a group of zero rows would be a zero-length reduction (which ``_scaled_grouped_mm``
rejects). The padded buffer has the static size P = ceil16(T*K) + 16*E; the last expert's group
runs to its end, so no row lies past the last offset. Empty slots (id -1) get no row at all.

``torch._scaled_grouped_mm`` has CUDA kernels only (sm_90). Elsewhere an emulation stands in
(:func:`emulated_scaled_grouped_mm`): it dequantizes the FP8 operands to bf16 (exact, the scales
being powers of two) and runs the bf16 ``_grouped_mm`` (fp32 accumulation), so the result differs
from the FP8 GEMM only by accumulation order; the quantization itself is the same code on both
paths. Every shape is static: this compiles with ``fullgraph=True`` (on CPU too, where this torch
has a CPU ``_grouped_mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common.routing import sort_by_expert
from kernels.moe import register_moe_backend
from kernels.fp8.rowwise import ALIGN, E4M3, E4M3_MAX, quantize_rowwise, scale_from_amax
from kernels.moe.grouped_mm import combine, grouped_mm

FAST_ACCUM = True  # torchao's FP8 grouped GEMMs use fast accumulation forward and backward


def route_by_expert_aligned(topk_ids_TK: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-grouped rows with every group padded to a multiple of 16 (at least 16 rows).

    Returns ``row_of_slot_N`` (the padded row of each (token, k) slot; 0 for an empty slot, which
    the combine masks), ``token_of_row_P`` (the token each row reads; T, a zero row, for padding)
    and ``offs_E`` (int32 cumulative group ends, the last equal to P).
    """
    T, K = topk_ids_TK.shape
    N, E = T * K, num_experts
    P = -(-N // ALIGN) * ALIGN + ALIGN * E  # holds sum_e max(ceil16(count_e), 16) for any routing
    device = topk_ids_TK.device
    sorted_slots_N, offsets_E1 = (t.long() for t in sort_by_expert(topk_ids_TK, E))
    counts_E = offsets_E1.diff()
    padded_E = ((counts_E + ALIGN - 1) // ALIGN).clamp(min=1) * ALIGN
    # Sorted row r belongs to expert e where offsets_E1[e] <= r < offsets_E1[e + 1]; rows from
    # offsets_E1[E] on are empty slots (sorted after every expert), placed with the last expert
    # and then dropped.
    r_N = torch.arange(N, device=device)
    valid_N = r_N < offsets_E1[E]
    # (searching all E+1 offsets, not a slice of them: inductor's CUDA searchsorted takes no view)
    e_N = (torch.searchsorted(offsets_E1, r_N, right=True) - 1).clamp(max=E - 1)
    # Row = start of the expert's padded group + rank among the expert's slots (sorted, stable).
    group_start_E = torch.cumsum(padded_E, 0) - padded_E
    rank_N = r_N - offsets_E1[e_N]
    row_sorted_N = group_start_E[e_N] + rank_N
    row_of_slot_N = torch.empty_like(row_sorted_N).scatter(0, sorted_slots_N, torch.where(valid_N, row_sorted_N, 0))
    token_of_row_P = torch.full((P + 1,), T, dtype=torch.int64, device=device)  # row P: a sink for empty slots
    token_of_row_P = token_of_row_P.scatter(0, torch.where(valid_N, row_sorted_N, P), sorted_slots_N // K)[:P]
    offs_E = torch.cumsum(padded_E, 0).to(torch.int32)
    offs_E = torch.cat([offs_E[:-1], offs_E.new_full((1,), P)])
    return row_of_slot_N, token_of_row_P, offs_E


def group_of_rows(offs_E: torch.Tensor, num_rows: int, step: int = 1) -> torch.Tensor:
    """The group of rows 0, step, 2*step, ... < num_rows, given the cumulative group ends."""
    rows = torch.arange(0, num_rows, step, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows, right=True)


def quantize_cols_grouped(x_PK: torch.Tensor, offs_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the rows within each group: one scale per (group, column).

    (P, K) float with group ends ``offs_E`` (multiples of 16) -> qt (K, P) e4m3, contiguous (the
    tokens are the reduction dim of the wgrad that reads it), s (E, K) fp32. The amax is taken per
    16-row block first (groups are whole blocks), then per group.
    """
    P, K = x_PK.shape
    E = offs_E.shape[0]
    x32 = x_PK.float()
    block_amax_BK = x32.abs().view(P // ALIGN, ALIGN, K).amax(dim=1)
    group_B = group_of_rows(offs_E, P, ALIGN)
    amax_EK = torch.zeros(E, K, dtype=torch.float32, device=x_PK.device)
    amax_EK = amax_EK.scatter_reduce(0, group_B.unsqueeze(1).expand(-1, K), block_amax_BK, reduce="amax")
    s_EK = scale_from_amax(amax_EK)
    q_PK = (x32 / s_EK[group_of_rows(offs_E, P)]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q_PK.t().contiguous(), s_EK


def emulated_scaled_grouped_mm(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                               offs_E: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (rowwise fp32 scales, bf16 out) as a bf16 grouped GEMM of the
    dequantized operands, in the two layouts of :func:`scaled_grouped_mm`. Exact dequantization:
    an e4m3 value (4 significant bits) times a power of two is a bf16 value."""
    E = offs_E.shape[0]
    if qb.dim() == 3:
        a = qa.float() * sa.unsqueeze(1)
        b = qb.float() * sb.unsqueeze(1)
    else:
        group_P = group_of_rows(offs_E, qa.shape[1])
        a = qa.float() * sa.view(E, -1)[group_P].t()
        b = qb.float() * sb.view(E, -1)[group_P]
    return grouped_mm(a.bfloat16(), b.bfloat16(), offs_E)


def scaled_grouped_mm(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      offs_E: torch.Tensor) -> torch.Tensor:
    """FP8 grouped GEMM with rowwise scales, bf16 out, in ``torch._scaled_grouped_mm``'s layouts:

    - (P, K) x (E, K, N) -> (P, N): a row-major with ``sa`` (P,), b column-major with ``sb`` (E, N);
    - (M, P) x (P, N) -> (E, M, N), the groups splitting P: a row-major with ``sa`` (E*M,), b
      column-major with ``sb`` (E*N,), a scale per (group, row of a) and (group, column of b).
    """
    if qa.is_cuda:
        return torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offs_E, out_dtype=torch.bfloat16,
                                        use_fast_accum=FAST_ACCUM)
    return emulated_scaled_grouped_mm(qa, qb, sa, sb, offs_E)


def fp8_grouped_mm_forward(a_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e of a times w[e]^T, both quantized rowwise over K: -> (P, N) bf16."""
    qa, sa = quantize_rowwise(a_PK)
    qw, sw = quantize_rowwise(w_ENK)
    return scaled_grouped_mm(qa, qw.transpose(-2, -1), sa.view(-1), sw.squeeze(-1), offs_E)


def fp8_grouped_wgrad(dout_PN: torch.Tensor, a_PK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Per group e: dout[rows of e]^T a[rows of e], both quantized along the rows: -> (E, N, K) bf16."""
    qd_NP, sd_EN = quantize_cols_grouped(dout_PN, offs_E)
    qa_KP, sa_EK = quantize_cols_grouped(a_PK, offs_E)
    return scaled_grouped_mm(qd_NP, qa_KP.t(), sd_EN.reshape(-1), sa_EK.reshape(-1), offs_E)


class _Fp8GroupedLinear(torch.autograd.Function):
    """out[rows of e] = a[rows of e] @ w[e]^T with FP8 forward, dgrad and wgrad (bf16 out)."""

    @staticmethod
    def forward(ctx, a_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a_PK, w_ENK, offs_E)
        return fp8_grouped_mm_forward(a_PK, w_ENK, offs_E)

    @staticmethod
    def backward(ctx, dout_PN: torch.Tensor):
        a_PK, w_ENK, offs_E = ctx.saved_tensors
        da_PK = dw_ENK = None
        if ctx.needs_input_grad[0]:
            da_PK = fp8_grouped_mm_forward(dout_PN, w_ENK.transpose(-2, -1), offs_E).to(a_PK.dtype)
        if ctx.needs_input_grad[1]:
            dw_ENK = fp8_grouped_wgrad(dout_PN, a_PK, offs_E).to(w_ENK.dtype)
        return da_PK, dw_ENK, None


def fp8_grouped_linear(a_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Differentiable FP8 grouped ``a @ w[e]^T`` over row groups ending at ``offs_E`` (multiples of
    16, the last equal to P): (P, K) x (E, N, K) -> (P, N) bf16."""
    return _Fp8GroupedLinear.apply(a_PK, w_ENK, offs_E)


@register_moe_backend("grouped_mm_fp8")
def moe_grouped_mm_fp8(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
) -> torch.Tensor:
    E, F_, D = w1_EFD.shape
    if D % ALIGN or F_ % ALIGN:
        raise ValueError(f"MoE backend 'grouped_mm_fp8': the model dim ({D}) and the expert hidden dim ({F_}) must "
                         f"be multiples of {ALIGN} for FP8 GEMMs")
    row_of_slot_N, token_of_row_P, offs_E = route_by_expert_aligned(topk_ids_TK, E)
    x_PD = F.pad(x_TD, (0, 0, 0, 1))[token_of_row_P]  # padding rows read the appended zero row
    gate_PF = fp8_grouped_linear(x_PD, w1_EFD, offs_E)
    up_PF = fp8_grouped_linear(x_PD, w3_EFD, offs_E)
    out_PD = fp8_grouped_linear(F.silu(gate_PF) * up_PF, w2_EDF, offs_E)
    return combine(out_PD, row_of_slot_N, topk_ids_TK, topk_weights_TK, x_TD.dtype)
