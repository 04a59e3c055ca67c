"""Backward of the FP8 mega-MoE op (the math of ``kernels/moe/mega/backward.py``, operands in e4m3).

With g, u the gate/up halves of H (saved by the forward, expert-sorted rows r, slot = sorted_slot[r]):

    dy_q, dy_s  = quantize_1x128(dy)                                   1 x 128 along D (on the Gluon
                                                                         engine in expert order)
    dA'[r]      = dy[tok(r)] @ w2[e]                                     fp8_grouped_gemm (fp32 out),
    ds[slot]    = rowsum(dA'[r] * silu(g) * u)                           then _dh_from_da_kernel: the
    dgate = s * dA' * u * silu'(g),  dup = s * dA' * silu(g)             SwiGLU backward, which also
                                                                         writes dH quantized 1 x 128
    dXbuf[slot] = [dgate | dup] @ [w1[e]; w3[e]];  dx[t] = sum_k dXbuf   fp8_grouped_gemm over
                                                                         K = 2F, scatter epilogue
    dW1[e] = dgate_e^T @ x_e, dW3[e] = dup_e^T @ x_e, dW2[e] = dy_e^T @ (s * A)_e
                  fp8_wgrad on operands quantized 128 x 1 along each expert's rows
                  (quantize_cols_grouped; x and dy gathered by token in that pass), one
                  zero-filled 128-column block per tile

Each GEMM runs on the engine the caller resolved (``kernels/fp8/engine.py``).

dA' is its own GEMM and the SwiGLU backward its own memory-bound kernel: fused into one kernel, the
GEMM's and the epilogue's tiles are live at once (registers spill, one CTA per SM), which was slower.

dgrad reads each weight transposed: w2[e] as (F, D) and [w1[e]; w3[e]] as (D, 2F). A 128 x 128
block's scale serves both orientations, so the transposed operand is the e4m3 bytes transposed,
written by the same quantization pass (``quantize_weight_into``), never a requantization. When F
is not a multiple of 128 the dX GEMM's K = 2F is laid out as two halves of F rounded up to 128
(zero padded), so that no 1 x 128 tile of dH and no weight block straddles the gate/up boundary.

Every sum has a fixed order (no float atomics): the backward is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.routing import max_tiles, tile_table
from kernels.common.triton_utils import cast_out, interpreting, tile_rows
from kernels.fp8 import engine as fp8_engine
from kernels.fp8.blockwise import (
    FP8,
    TILE,
    quantize_cols_grouped,
    quantize_tile,
    quantize_weight_into,
    scale_from_amax,
    to_e4m3_bits,
)
from kernels.moe.combine import combine_slots, valid_slots
from kernels.moe.mega_fp8.forward import gemm_blocks
from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

# Rows per program of the dH epilogue kernel (memory-bound; ~6 fp32 tiles of 128 columns live).
DH_EPILOGUE_BLOCK_M = 32


@triton.jit
def _store_quantized_half(v, nmask, rows64, rmask, offs_n, col0, tile, q_ptr, s_ptr, FP, FB,
                          POW2: tl.constexpr, SOFT: tl.constexpr):
    """One 1 x 128 tile per row of ``v`` (already rounded to the activation dtype) stored as e4m3 at
    columns ``col0 + offs_n`` of rows of 2 * FP bytes, its scale at column ``tile`` of rows of 2 * FB."""
    vf = tl.where(nmask[None, :], v.to(tl.float32), 0.0)  # the padding past F is written as zeros
    s = scale_from_amax(tl.max(tl.abs(vf), axis=1), POW2)
    q = to_e4m3_bits(quantize_tile(vf, s[:, None]), SOFT)
    qmask = rmask[:, None] & (offs_n < FP)[None, :]
    tl.store(q_ptr + rows64[:, None] * (2 * FP) + col0 + offs_n[None, :], q, mask=qmask)
    tl.store(s_ptr + rows64 * (2 * FB) + tile, s, mask=rmask)


@triton.jit
def _dh_tile(table_ptr, offsets_ptr, sorted_slot_ptr, num_tiles, F, BLOCK_M: tl.constexpr):
    """Program -> its tile of (expert-sorted rows) x (128 columns of F): (expert, or -1 for a surplus
    tile; rows; row mask; the rows' slots, 0 past the expert's end; column-tile index; columns)."""
    pid = tl.program_id(0)
    FB = tl.cdiv(F, 128)
    pid_n = pid % FB
    expert, rows, rmask, _ = tile_rows(table_ptr, offsets_ptr, num_tiles, pid // FB, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
    return expert, rows, rmask, slot, pid_n, pid_n * 128 + tl.arange(0, 128)


@triton.jit
def _dh_from_da_kernel(
    da_ptr,  # (N, F) fp32: dA' by expert-sorted row (fp8_grouped_gemm)
    h_ptr,  # (N, 2F) [gate | up]
    s_ptr,  # (N,) fp32 routing weights by slot
    dh_ptr,  # (N, 2F) out
    dhq_ptr,  # (N, 2 * FP) uint8 out
    dhs_ptr,  # (N, 2 * FB) fp32 out
    sa_ptr,  # (N, F) out (if STORE_SA)
    ds_part_ptr,  # (FB, N) fp32 out
    sorted_slot_ptr,
    offsets_ptr,
    table_ptr,
    num_tiles,
    N,
    F,
    BLOCK_M: tl.constexpr,
    STORE_SA: tl.constexpr,
    POW2: tl.constexpr,
    SOFT: tl.constexpr,
):
    """The SwiGLU backward over dA' (computed by fp8_grouped_gemm): dH, its 1 x 128 quantization,
    s * A and the partial ds, one 128-column tile of F per program."""
    expert, rows, rmask, slot, pid_n, offs_n = _dh_tile(table_ptr, offsets_ptr, sorted_slot_ptr, num_tiles, F,
                                                        BLOCK_M)
    if expert < 0:
        return
    FB = tl.cdiv(F, 128)
    # Columns past F read as 0.
    amask = rmask[:, None] & (offs_n < F)[None, :]
    acc = tl.load(da_ptr + rows.to(tl.int64)[:, None] * F + offs_n[None, :], mask=amask, other=0.0)
    _dh_epilogue(acc, rows, rmask, slot, offs_n, pid_n, s_ptr, h_ptr, dh_ptr, dhq_ptr, dhs_ptr, sa_ptr,
                 ds_part_ptr, N, F, FB, STORE_SA, POW2, SOFT)


@triton.jit
def _dh_values(acc, rmask, slot, smask, rows64, offs_n, s_ptr, h_ptr, F, SOFT: tl.constexpr):
    """From dA' (``acc``, fp32, one 128-column tile of F): the SwiGLU backward from H as the bf16
    kernel's epilogue does. Returns dgate, dup (rounded to H's dtype), s * A (A rounded as in the
    forward, then scaled and rounded: what dW2 multiplies) and this tile's partial ds."""
    s = tl.load(s_ptr + slot, mask=rmask, other=0.0)
    h_ptrs = h_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    g = tl.load(h_ptrs, mask=smask, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + F, mask=smask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    act = silu * u
    ds_part = tl.sum(acc * act, axis=1)
    da = acc * s[:, None]
    dtype = h_ptr.dtype.element_ty
    dgate = cast_out(da * u * sig * (1.0 + g * (1.0 - sig)), dtype, SOFT)
    dup = cast_out(da * silu, dtype, SOFT)
    sa = cast_out(cast_out(act, dtype, SOFT).to(tl.float32) * s[:, None], dtype, SOFT)
    return dgate, dup, sa, ds_part


@triton.jit
def _dh_epilogue(acc, rows, rmask, slot, offs_n, pid_n, s_ptr, h_ptr, dh_ptr, dhq_ptr, dhs_ptr, sa_ptr,
                 ds_part_ptr, N, F, FB, STORE_SA: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr):
    """:func:`_dh_values`, then dH stored and quantized 1 x 128, s * A, and this tile's partial ds."""
    rows64 = rows.to(tl.int64)
    nmask = offs_n < F
    smask = rmask[:, None] & nmask[None, :]
    dgate, dup, sa, ds_part = _dh_values(acc, rmask, slot, smask, rows64, offs_n, s_ptr, h_ptr, F, SOFT)
    dh_ptrs = dh_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    tl.store(dh_ptrs, dgate, mask=smask)
    tl.store(dh_ptrs + F, dup, mask=smask)
    # Quantized from the rounded dH, so each half equals quantize_1x128 of the stored one.
    FP = FB * 128
    _store_quantized_half(dgate, nmask, rows64, rmask, offs_n, 0, pid_n, dhq_ptr, dhs_ptr, FP, FB, POW2, SOFT)
    _store_quantized_half(dup, nmask, rows64, rmask, offs_n, FP, FB + pid_n, dhq_ptr, dhs_ptr, FP, FB, POW2, SOFT)
    if STORE_SA:
        tl.store(sa_ptr + rows64[:, None] * F + offs_n[None, :], sa, mask=smask)
    # Partial ds of this F-tile; the launcher sums the partials in a fixed order.
    tl.store(ds_part_ptr + pid_n * N + slot, ds_part, mask=rmask)


def dh_swiglu(
    dy_q: torch.Tensor,
    dy_s: torch.Tensor,
    w2t_q: torch.Tensor,
    w2t_s: torch.Tensor,
    h_N2F: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    store_sa: bool = True,
    pow2_scales: bool = False,
    engine: str = "triton",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """FP8 dA' = dy_gathered @ w2[e] with the SwiGLU backward and the routing-weight grad as epilogue.

    Args:
        dy_q, dy_s: dy's 1 x 128 quantization in the layout ``engine`` reads
            (``kernels/fp8/engine.quantize_routed_rows``): (T, D) e4m3 and (T, ceil(D/128)) fp32 on
            Triton (``quantize_1x128(dy)``); on Gluon (N, D) and (N, ceil(D/128)) in expert order,
            as its dA' GEMM loads them by TMA.
        w2t_q, w2t_s: (E, F, D) e4m3 and (E, ceil(F/128), ceil(D/128)) fp32: w2's quantized bytes
            and block scales transposed (``q.mT``, ``s.mT``, contiguous).
        h_N2F: (N, 2F) [gate | up] from the forward; topk_weights_TK: (T, K) fp32.
        sorted_slot_N: (N,) int32, offsets_E1: (E+1,) int32 (``sort_by_expert``).
        engine: "gluon" or "triton" for the dA' GEMM. Gluon reads A in order (TMA), so the caller
            puts dy's rows in expert order: up to ~N x D bytes written and read, which the faster
            GEMM repays (BENCHMARKS.md).
    Returns:
        dh_N2F: (N, 2F) [dgate | dup] in h's dtype, expert-sorted rows.
        (dh_q, dh_s): (N, 2 * FP) e4m3 and (N, 2 * ceil(F/128)) fp32, FP = F rounded up to 128:
            dgate at columns [0, F), dup at [FP, FP + F), zeros between; each half is
            ``quantize_1x128`` of the stored dgate / dup.
        ds_TK: (T, K) fp32 routing-weight gradient (empty slots: undefined, the caller masks).
        sa_NF: (N, F) s * silu(g) * u in h's dtype (None unless store_sa): dW2's operand.
        Rows r >= offsets_E1[E] (empty slots) are not written.
    """
    T, K = topk_weights_TK.shape
    E, F, D = w2t_q.shape
    N = T * K
    FB = triton.cdiv(F, TILE)
    dev = h_N2F.device
    dh_N2F = torch.empty_like(h_N2F)
    dh_q = torch.empty((N, 2 * FB * TILE), device=dev, dtype=FP8)
    dh_s = torch.empty((N, 2 * FB), device=dev, dtype=torch.float32)
    sa_NF = torch.empty((N, F), device=dev, dtype=h_N2F.dtype) if store_sa else None
    ds_part_PN = torch.empty((FB, N), device=dev, dtype=torch.float32)
    if N == 0:
        return dh_N2F, (dh_q, dh_s), ds_part_PN.sum(0).view(T, K), sa_NF
    gbm, _ = gemm_blocks()
    da_NF = fp8_engine.gathered_grouped_gemm(dy_q, dy_s, w2t_q, w2t_s, sorted_slot_N, offsets_E1, K, torch.float32,
                                             engine=engine, block_m=gbm, block_n=TILE)
    ebm = 16 if interpreting() else DH_EPILOGUE_BLOCK_M
    e_tiles = max_tiles(N, E, ebm)
    _dh_from_da_kernel[(e_tiles * FB,)](
        da_NF, h_N2F, topk_weights_TK, dh_N2F, dh_q.view(torch.uint8), dh_s, sa_NF if store_sa else dh_N2F,
        ds_part_PN, sorted_slot_N, offsets_E1, tile_table(offsets_E1, N, ebm), e_tiles, N, F,
        BLOCK_M=ebm, STORE_SA=store_sa, POW2=pow2_scales, SOFT=interpreting(),
        num_warps=8 if not interpreting() else 4,
    )  # fmt: skip
    return dh_N2F, (dh_q, dh_s), ds_part_PN.sum(0).view(T, K), sa_NF


def _wgrad_blocks() -> tuple[int | None, int | None]:
    """fp8_wgrad's (block_m, block_n): its defaults on the GPU; whole 128 x 128 output tiles under
    the interpreter, whose cost is per program."""
    return (128, 128) if interpreting() else (None, None)


def _transposed(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes transposed in the last two dims, contiguous (copied as uint8: plain bytes)."""
    return q.view(torch.uint8).mT.contiguous().view(FP8)


def transposed_weight(w_ENK: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q.mT, s.mT) of ``quantize_weight(w)``, contiguous: (E, K, N) e4m3 and (E, ceil(K/128),
    ceil(N/128)) fp32, written by the quantization pass itself (no strided byte copy)."""
    E, N, K = w_ENK.shape
    q, s = torch.empty_like(w_ENK, dtype=FP8), w_ENK.new_empty((E, triton.cdiv(N, TILE), triton.cdiv(K, TILE)),
                                                                dtype=torch.float32)
    qt = torch.empty((E, K, N), device=w_ENK.device, dtype=FP8)
    st = torch.empty((E, triton.cdiv(K, TILE), triton.cdiv(N, TILE)), device=w_ENK.device, dtype=torch.float32)
    quantize_weight_into(w_ENK, q, s, qt, st, pow2_scales=pow2_scales)
    return qt, st


def dx_weight(w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, pow2_scales: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """[w1[e]; w3[e]] read as the (D, 2F) B operand of the dX GEMM, in e4m3.

    Returns:
        q: (E, D, 2 * FP) e4m3, w1[e]^T at columns [0, F), w3[e]^T at [FP, FP + F), zeros between
            (FP = F rounded up to 128), matching the layout of :func:`dh_swiglu`'s dH.
        s: (E, ceil(D/128), 2 * ceil(F/128)) fp32 block scales.
    Written by the quantization passes (``quantize_weight_into``): a torch.cat of the transposed
    halves would be another pass over the weights' bytes, a slow one.
    """
    E, F, D = w1_EFD.shape
    FB = triton.cdiv(F, TILE)
    q = torch.empty((E, D, 2 * FB * TILE), device=w1_EFD.device, dtype=FP8)
    s = torch.empty((E, triton.cdiv(D, TILE), 2 * FB), device=w1_EFD.device, dtype=torch.float32)
    w_q, w_s = torch.empty_like(w1_EFD, dtype=FP8), torch.empty((E, FB, triton.cdiv(D, TILE)),
                                                                 device=w1_EFD.device, dtype=torch.float32)
    for i, w in enumerate((w1_EFD, w3_EFD)):  # each pass also writes its half's padding columns
        quantize_weight_into(w.contiguous(), w_q, w_s, q, s, i * FB * TILE, FB * TILE, i * FB, pow2_scales)
    return q, s


def moe_fp8_backward(
    dy_TD: torch.Tensor, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor,  # the gradient, the layer's inputs
    w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor, sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor,  # saved by the forward
    pow2_scales: bool = False, quantized: QuantizedExpertWeights | None = None, engine: str = "triton",
    write_empty_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the FP8 backward. ``engine`` ("gluon" or "triton", resolved by the caller) runs the
    weight-gradient GEMMs, the dX GEMM and dA' (``kernels/fp8/engine.py``). Inputs contiguous, dy/x
    bf16, routing weights fp32; the weights bf16, or of any float dtype when ``quantized`` holds
    their e4m3 copies (then only their shapes and dtypes are read).
    Empty slots (expert id -1) get zero gradients; an expert with no rows gets zero weight grads.
    Only rows of dy and x with a routed slot are read; ``write_empty_rows`` False leaves dx's rows of
    tokens with none undefined.

    Returns:
        dx_TD (x's dtype), dw1_EFD, dw3_EFD, dw2_EDF (each in its weight's dtype), dtopk_weights_TK (fp32).
    """
    T, K = topk_weights_TK.shape
    F = w1_EFD.shape[1]
    N = T * K
    # Empty slots' rows lie past every expert's tiles: skipped in the sum, zeroed in ds, and dy rows
    # of tokens with no valid slot (expert parallelism's empty rows) are never gathered.
    valid_N = valid_slots(sorted_slot_N, offsets_E1)
    # The Gluon dA' GEMM reads dy's rows in expert order, as the forward's gate/up reads x's.
    dy_q, dy_s = fp8_engine.quantize_routed_rows(dy_TD, valid_N.view(T, K), sorted_slot_N, offsets_E1, pow2_scales,
                                                 engine=engine)
    if quantized is None:
        w2t_q, w2t_s = transposed_weight(w2_EDF, pow2_scales)
    else:
        w2t_q, w2t_s = quantized.w2t_q, quantized.w2t_s
    tiles128 = tile_table(offsets_E1, N, TILE)
    dh_N2F, (dh_q, dh_s), ds_TK, sa_NF = dh_swiglu(
        dy_q, dy_s, w2t_q, w2t_s, h_N2F, topk_weights_TK, sorted_slot_N, offsets_E1,
        store_sa=True, pow2_scales=pow2_scales, engine=engine,
    )  # fmt: skip
    del dy_q, dy_s, w2t_q, w2t_s

    if quantized is None:
        w13t_q, w13t_s = dx_weight(w1_EFD, w3_EFD, pow2_scales)
    else:
        w13t_q, w13t_s = quantized.w13t_q, quantized.w13t_s
    bm, bn = gemm_blocks()
    dxbuf_ND = fp8_engine.grouped_gemm(dh_q, dh_s, w13t_q, w13t_s, offsets_E1, x_TD.dtype, engine=engine, block_m=bm,
                                       block_n=bn, out_slot_N=sorted_slot_N)
    del dh_q, dh_s, w13t_q, w13t_s
    dx_TD = combine_slots(dxbuf_ND, T, K, sorted_slot_N, offsets_E1, valid_N, write_empty_rows)
    del dxbuf_ND
    ds_TK = torch.where(valid_N.view(T, K) != 0, ds_TK, 0.0)

    # Weight gradients: both operands quantized along the reduction (token) dim in 128-row blocks of
    # one expert. dH's 2F columns are quantized in one pass; its gate and dup halves are contiguous row
    # ranges of the transposed copy, so dW1 and dW3 are two GEMMs with no slicing copy.
    xt_q, xt_s = quantize_cols_grouped(x_TD, offsets_E1, sorted_slot_N, K, pow2_scales, tiles128)
    dht_q, dht_s = quantize_cols_grouped(dh_N2F, offsets_E1, None, 1, pow2_scales, tiles128)
    del dh_N2F
    wbm, wbn = _wgrad_blocks()
    dw1_EFD = fp8_engine.wgrad(dht_q[:F], dht_s[:F], xt_q, xt_s, offsets_E1, w1_EFD.dtype, engine=engine, block_m=wbm,
                               block_n=wbn)
    dw3_EFD = fp8_engine.wgrad(dht_q[F:], dht_s[F:], xt_q, xt_s, offsets_E1, w3_EFD.dtype, engine=engine, block_m=wbm,
                               block_n=wbn)
    del xt_q, xt_s, dht_q, dht_s
    dyt_q, dyt_s = quantize_cols_grouped(dy_TD, offsets_E1, sorted_slot_N, K, pow2_scales, tiles128)
    sat_q, sat_s = quantize_cols_grouped(sa_NF, offsets_E1, None, 1, pow2_scales, tiles128)
    dw2_EDF = fp8_engine.wgrad(dyt_q, dyt_s, sat_q, sat_s, offsets_E1, w2_EDF.dtype, engine=engine, block_m=wbm,
                               block_n=wbn)
    return dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, ds_TK
