"""Plain-PyTorch reference of the FP8 mega-MoE op: the same quantization steps, GEMMs in float64.

Each e4m3 operand is made by the torch references of ``kernels/fp8/blockwise.py`` (bit-identical to the
kernels), each GEMM is float64 on the dequantized operands, and every intermediate is rounded to
the activation dtype where the kernels round it (H, A, dH, s * A, the per-slot rows). So the op and
this reference differ only by fp32 accumulation order and the rare rounding flip it causes: a
tight oracle for the quantized pipeline, where ``kernels/moe/reference.py`` (unquantized) can only
bound the error at the FP8 level. Host loops over experts; tests only.

The functions take and return what the custom ops do (``op.py``), so the two can be fed the same
saved tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common.routing import sort_by_expert
from kernels.fp8.grouped_gemm import fp8_gate_up_swiglu_ref, fp8_grouped_gemm_ref, fp8_wgrad_ref
from kernels.fp8.blockwise import quantize_cols_grouped_ref, quantize_1x128_ref, quantize_weight_ref


def _slot_rows(buf_ND: torch.Tensor, valid_N: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, K, D) float64: the per-slot rows rounded to ``dtype`` (as the kernels store them), zero
    for invalid slots."""
    rows = torch.where(valid_N[:, None], buf_ND.to(dtype).double(), 0.0)
    return rows.view(T, -1, buf_ND.shape[1])


def _sum_valid_slots(buf_ND: torch.Tensor, valid_N: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_k buf[t*K + k] over the valid slots, buf rounded to ``dtype`` first, fp32 sum."""
    return _slot_rows(buf_ND, valid_N, T, dtype).float().sum(1).to(dtype)


def _valid_slot_abs_sum(buf_ND: torch.Tensor, valid_N: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """sum_k |buf[t*K + k]| over the valid slots (rows rounded to ``dtype``), float64: the scale of
    the per-slot rounding error in a sum over k. When slots cancel, one ulp of a slot can exceed an
    ulp of the sum, so comparisons of such sums measure their error against this, not the sum."""
    return _slot_rows(buf_ND, valid_N, T, dtype).abs().sum(1)


def _by_slot(rows_N: torch.Tensor, sorted_slot_N: torch.Tensor) -> torch.Tensor:
    """Expert-sorted rows -> slot order (row r goes to slot sorted_slot[r])."""
    return torch.zeros_like(rows_N).index_copy(0, sorted_slot_N.long(), rows_N)


def mega_moe_fp8_forward_ref(x_TD, topk_ids_TK, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, pow2_scales=False,
                             with_magnitude=False):
    """Reference of ``mega_moe_fp8::forward``: (y_TD, h_N2F, sorted_slot_N, offsets_E1), and with
    ``with_magnitude`` a fifth tensor, sum_k |slot row| of y (see ``_valid_slot_abs_sum``)."""
    T, K = topk_ids_TK.shape
    dtype = x_TD.dtype
    sorted_slot_N, offsets_E1 = sort_by_expert(topk_ids_TK, w1_EFD.shape[0])
    x_q, x_s = quantize_1x128_ref(x_TD, pow2_scales)
    w1_q, w1_s = quantize_weight_ref(w1_EFD, pow2_scales)
    w3_q, w3_s = quantize_weight_ref(w3_EFD, pow2_scales)
    w2_q, w2_s = quantize_weight_ref(w2_EDF, pow2_scales)
    g, u, _ = fp8_gate_up_swiglu_ref(x_q, x_s, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, K)
    g, u = g.to(dtype), u.to(dtype)
    a = (F.silu(g.float()) * u.float()).to(dtype)  # from the rounded gate/up, as the kernel
    a_q, a_s = quantize_1x128_ref(a, pow2_scales)
    ybuf = fp8_grouped_gemm_ref(a_q, a_s, w2_q, w2_s, offsets_E1, out_slot_N=sorted_slot_N,
                                slot_weights_N=topk_weights_TK.reshape(-1).float())
    valid_N = topk_ids_TK.reshape(-1) >= 0
    y_TD = _sum_valid_slots(ybuf, valid_N, T, dtype)
    out = (y_TD, torch.cat([g, u], 1), sorted_slot_N, offsets_E1)
    if with_magnitude:
        out += (_valid_slot_abs_sum(ybuf, valid_N, T, dtype),)
    return out


def mega_moe_fp8_backward_ref(dy_TD, x_TD, topk_weights_TK, w1_EFD, w3_EFD, w2_EDF, h_N2F, sorted_slot_N,
                              offsets_E1, pow2_scales=False, with_magnitude=False):
    """Reference of ``mega_moe_fp8::backward``: (dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, dtopk_weights_TK),
    and with ``with_magnitude`` two more: sum_k |slot row| of dx (``_valid_slot_abs_sum``) and, per
    slot, sum_f |dA' * act| (the terms of dtopk_weights, which cancel).
    """
    T, K = topk_weights_TK.shape
    Fh = w1_EFD.shape[1]
    dtype = x_TD.dtype
    slot = sorted_slot_N.long()
    n = int(offsets_E1[-1])  # rows past n are empty slots: H there is garbage, their weights may be NaN

    def pad(rows_nX):  # n expert-sorted rows -> N, zeros for the empty slots
        return torch.cat([rows_nX, rows_nX.new_zeros(T * K - n, *rows_nX.shape[1:])])

    dy_q, dy_s = quantize_1x128_ref(dy_TD, pow2_scales)
    w2_q, w2_s = quantize_weight_ref(w2_EDF, pow2_scales)
    da = fp8_grouped_gemm_ref(dy_q, dy_s, w2_q.mT.contiguous(), w2_s.mT.contiguous(), offsets_E1, sorted_slot_N, K)[:n]
    g, u = h_N2F[:n, :Fh].double(), h_N2F[:n, Fh:].double()
    s_n1 = topk_weights_TK.reshape(-1).double()[slot[:n]][:, None]
    sig = torch.sigmoid(g)
    act = g * sig * u
    ds_TK = _by_slot(pad((da * act).sum(1)), sorted_slot_N).float().view(T, K)
    ds_mag_TK = _by_slot(pad((da * act).abs().sum(1)), sorted_slot_N).float().view(T, K) if with_magnitude else None
    dgate = pad((da * s_n1 * u * sig * (1 + g * (1 - sig))).to(dtype))
    dup = pad((da * s_n1 * g * sig).to(dtype))

    dxbuf = 0
    for half, w in ((dgate, w1_EFD), (dup, w3_EFD)):
        h_q, h_s = quantize_1x128_ref(half, pow2_scales)
        w_q, w_s = quantize_weight_ref(w, pow2_scales)
        dxbuf = dxbuf + fp8_grouped_gemm_ref(h_q, h_s, w_q.mT.contiguous(), w_s.mT.contiguous(), offsets_E1,
                                             out_slot_N=sorted_slot_N)
    in_expert_N = torch.arange(T * K, device=x_TD.device) < n
    valid_N = _by_slot(in_expert_N, sorted_slot_N)
    dx_TD = _sum_valid_slots(dxbuf, valid_N, T, dtype)
    dx_mag_TD = _valid_slot_abs_sum(dxbuf, valid_N, T, dtype) if with_magnitude else None

    sa = pad((act.to(dtype).double() * s_n1).to(dtype))
    wt = []
    for rows, src_slots, k in ((dgate, None, 1), (dup, None, 1), (x_TD, sorted_slot_N, K),
                               (dy_TD, sorted_slot_N, K), (sa, None, 1)):
        wt.append(quantize_cols_grouped_ref(rows, offsets_E1, src_slots, k, pow2_scales))
    dw1 = fp8_wgrad_ref(*wt[0], *wt[2], offsets_E1)
    dw3 = fp8_wgrad_ref(*wt[1], *wt[2], offsets_E1)
    dw2 = fp8_wgrad_ref(*wt[3], *wt[4], offsets_E1)
    out = (dx_TD, dw1.to(dtype), dw3.to(dtype), dw2.to(dtype), ds_TK)
    return out + (dx_mag_TD, ds_mag_TK) if with_magnitude else out
