"""Backward kernels of the mega-MoE op.

With g, u the gate/up halves of H (saved by the forward, expert-sorted rows r, slot = sorted_slot[r]):

    dA'[r]  = dy[tok(r)] @ w2[e]                                  (_dh_kernel, M-tiled)
    ds[slot] = rowsum(dA'[r] * silu(g) * u)                       (same epilogue, per-F-tile partials)
    dgate   = s * dA' * u * silu'(g),  dup = s * dA' * silu(g)    (same epilogue, stored as dH)
    dXbuf[slot] = dgate @ w1[e] + dup @ w3[e];  dx[t] = sum_k dXbuf[t*K+k]   (_dx_kernel)
    [dW1[e]; dW3[e]] = [dgate | dup]_e^T @ x_e                    (_dw13_kernel, one GEMM over 2F)
    dW2[e] = dy_e^T @ (s * silu(g) * u)_e                          (_dw2_kernel)

In these Triton kernels dy and x rows are gathered by token index inside the loads. s * A for dW2 is
written by the dH epilogue (an N x F buffer alive only during the backward): rebuilding it inside
the dW2 loads would recompute the SwiGLU once per D-tile, which was slower on the H200.

The weight-gradient kernels are grouped GEMMs whose reduction runs over the variable row range of
one expert: a grid of E * m_tiles * n_tiles programs, expert slowest; an expert with no rows
stores exact zeros. On the H200 they reach only ~330 TFLOP/s (short K loops of ~1024 rows per
expert), so for bf16 the default (``MegaMoEConfigs.grouped_mm_backward``) runs the backward's GEMMs
through cuBLAS's ``torch._grouped_mm`` instead, on x and dy rows copied into expert order inside
the backward (transient, 0.5 GB each at the 30B shape; nothing more is saved for backward): the
weight gradients (K-grouped), dA' = dy_e @ w2[e] with the dh kernel's SwiGLU-backward epilogue run
as its own elementwise kernel (:func:`_swiglu_bwd_kernel`), and dX as two grouped GEMMs and a
gather-sum over k. The fused Triton kernels remain the path of every other dtype.
Every sum has a fixed order (no float atomics), so the backward is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.routing import gather_sorted_rows, tile_table
from kernels.common.tiles import TileConfig, launch_options, m_tiled_launch
from kernels.common.triton_utils import (expert_tile, interpreting, launch_flags, load_k, m_tile_rows, mma, n_tile_cols,
                                         num_work)
from kernels.moe.combine import combine_slots, sum_over_k, valid_slots
from kernels.moe.grouped_mm import grouped_mm
from kernels.moe.mega.configs import MegaMoEConfigs, get_configs


@triton.jit
def _dh_kernel(
    dy_ptr,  # (T, D)
    w2_ptr,  # (E, D, F)
    h_ptr,  # (N, 2F) [gate | up]
    s_ptr,  # (N,) fp32 by slot
    dh_ptr,  # (N, 2F) out: [dgate | dup]
    sa_ptr,  # (N, F) out: s * silu(g) * u, the B operand of dW2
    ds_part_ptr,  # (cdiv(F, BLOCK_N), N) fp32 out: partial routing-weight grads by slot
    sorted_slot_ptr,
    offsets_ptr,
    table_ptr,
    num_tiles,
    N,
    K_TOP,
    D,
    F,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    NUM_PROGS,
    PERSISTENT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    num_n = tl.cdiv(F, BLOCK_N)
    for work in tl.range(tl.program_id(0), num_work(table_ptr, num_tiles, num_n), NUM_PROGS, flatten=PERSISTENT):
        pid_n, expert, rows, rmask, _ = m_tile_rows(work, num_n, table_ptr, offsets_ptr, num_tiles, BLOCK_M)
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        tok = (slot // K_TOP).to(tl.int64)
        offs_n, offs_n_ld, offs_k = n_tile_cols(pid_n, F, BLOCK_N, BLOCK_K)
        dy_ptrs = dy_ptr + tok[:, None] * D + offs_k[None, :]
        w_ptrs = w2_ptr + expert.to(tl.int64) * D * F + offs_k[:, None] * F + offs_n_ld[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = load_k(dy_ptrs, offs_k, k0, D, EVEN_K, 1)
            b = load_k(w_ptrs, offs_k, k0, D, EVEN_K, 0)
            acc = mma(a, b, acc, UPCAST, IEEE)
            dy_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * F

        s = tl.load(s_ptr + slot, mask=rmask, other=0.0)
        rows64 = rows.to(tl.int64)
        if EPI_SPLIT == 2:
            # The epilogue keeps ~6 fp32 tiles live; doing it one column half at a time lets a
            # 128-wide tile run without spilling.
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            offs_lo = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            ds_part = _dh_epilogue(acc_lo, rows64, rmask, s, offs_lo, h_ptr, dh_ptr, sa_ptr, F)
            ds_part += _dh_epilogue(acc_hi, rows64, rmask, s, offs_lo + BLOCK_N // 2, h_ptr, dh_ptr, sa_ptr, F)
        else:
            ds_part = _dh_epilogue(acc, rows64, rmask, s, offs_n, h_ptr, dh_ptr, sa_ptr, F)
        # Partial ds of this F-tile; the launcher sums the partials in a fixed order.
        tl.store(ds_part_ptr + pid_n * N + slot, ds_part, mask=rmask)


@triton.jit
def _dh_epilogue(acc, rows64, rmask, s, offs_n, h_ptr, dh_ptr, sa_ptr, F):
    """SwiGLU backward of one (rows x offs_n) tile of dA' = acc: stores dH and s * A, returns the
    tile's part of ds per row."""
    smask = rmask[:, None] & (offs_n < F)[None, :]
    h_ptrs = h_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    g = tl.load(h_ptrs, mask=smask, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + F, mask=smask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    ds_part = tl.sum(acc * (silu * u), axis=1)
    da = acc * s[:, None]
    dgate = da * u * sig * (1.0 + g * (1.0 - sig))
    dup = da * silu
    dtype = dh_ptr.dtype.element_ty
    dh_ptrs = dh_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    tl.store(dh_ptrs, dgate.to(dtype), mask=smask)
    tl.store(dh_ptrs + F, dup.to(dtype), mask=smask)
    # A rounded to the activation dtype as in the forward, then scaled: what dW2 multiplies.
    sa = (silu * u).to(dtype).to(tl.float32) * s[:, None]
    tl.store(sa_ptr + rows64[:, None] * F + offs_n[None, :], sa.to(dtype), mask=smask)
    return ds_part


@triton.jit
def _swiglu_bwd_kernel(
    da_ptr,  # (N, F) dA' rows in expert order (from a cuBLAS grouped GEMM)
    h_ptr,  # (N, 2F) [gate | up]
    s_ptr,  # (N,) fp32 by slot
    dh_ptr,  # (N, 2F) out
    sa_ptr,  # (N, F) out
    ds_ptr,  # (N,) fp32 out by slot (zero-initialised: empty slots keep 0)
    sorted_slot_ptr,
    offsets_ptr,
    E,
    F,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """The dh kernel's epilogue on its own, for dA' computed elsewhere; ds needs no partials since
    each program sees whole rows."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < tl.load(offsets_ptr + E)  # rows past the last expert (empty slots) are undefined
    slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
    s = tl.load(s_ptr + slot, mask=rmask, other=0.0)
    rows64 = rows.to(tl.int64)
    ds = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        da_mask = rmask[:, None] & (offs_f < F)[None, :]
        da = tl.load(da_ptr + rows64[:, None] * F + offs_f[None, :], mask=da_mask, other=0.0).to(tl.float32)
        ds += _dh_epilogue(da, rows64, rmask, s, offs_f, h_ptr, dh_ptr, sa_ptr, F)
    tl.store(ds_ptr + slot, ds, mask=rmask)


@triton.jit
def _dx_kernel(
    dh_ptr,  # (N, 2F) [dgate | dup]
    w1_ptr,  # (E, F, D)
    w3_ptr,  # (E, F, D)
    dxbuf_ptr,  # (N, D) out: by slot
    sorted_slot_ptr,
    offsets_ptr,
    table_ptr,
    num_tiles,
    D,
    F,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_PROGS,
    PERSISTENT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    num_n = tl.cdiv(D, BLOCK_N)
    for work in tl.range(tl.program_id(0), num_work(table_ptr, num_tiles, num_n), NUM_PROGS, flatten=PERSISTENT):
        pid_n, expert, rows, rmask, safe_rows = m_tile_rows(work, num_n, table_ptr, offsets_ptr, num_tiles, BLOCK_M)
        offs_n, offs_n_ld, offs_k = n_tile_cols(pid_n, D, BLOCK_N, BLOCK_K)
        dg_ptrs = dh_ptr + safe_rows.to(tl.int64)[:, None] * (2 * F) + offs_k[None, :]
        w_off = expert.to(tl.int64) * F * D + offs_k[:, None] * D + offs_n_ld[None, :]
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off

        # One accumulator for both halves: dX = [dgate | dup] @ [w1[e]; w3[e]].
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            dg = load_k(dg_ptrs, offs_k, k0, F, EVEN_K, 1)
            du = load_k(dg_ptrs + F, offs_k, k0, F, EVEN_K, 1)
            b1 = load_k(w1_ptrs, offs_k, k0, F, EVEN_K, 0)
            b3 = load_k(w3_ptrs, offs_k, k0, F, EVEN_K, 0)
            acc = mma(dg, b1, acc, UPCAST, IEEE)
            acc = mma(du, b3, acc, UPCAST, IEEE)
            dg_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K * D
            w3_ptrs += BLOCK_K * D

        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        smask = rmask[:, None] & (offs_n < D)[None, :]
        out_ptrs = dxbuf_ptr + slot.to(tl.int64)[:, None] * D + offs_n[None, :]
        tl.store(out_ptrs, acc.to(dxbuf_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _dw13_kernel(
    x_ptr,  # (T, D)
    dh_ptr,  # (N, 2F) [dgate | dup]
    dw1_ptr,  # (E, F, D) out
    dw3_ptr,  # (E, F, D) out
    sorted_slot_ptr,
    offsets_ptr,
    K_TOP,
    D,
    F,
    BLOCK_M: tl.constexpr,  # over the 2F columns of dH: [dW1[e]; dW3[e]] is one (2F, D) product
    BLOCK_N: tl.constexpr,  # over D
    BLOCK_K: tl.constexpr,  # over the expert's rows
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    expert, offs_m, offs_n, start, end = expert_tile(tl.program_id(0), 2 * F, D, offsets_ptr, BLOCK_M, BLOCK_N)
    # One accumulator over [dgate | dup] rather than one per half: one store path, and any tile
    # height. It measured as fast as two accumulators sharing x; the larger tiles it allows were
    # slower.
    offs_m_ld = offs_m % (2 * F)
    offs_n_ld = offs_n % D
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        rmask = rows < end
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        tok = (slot // K_TOP).to(tl.int64)
        xt = tl.load(x_ptr + tok[:, None] * D + offs_n_ld[None, :], mask=rmask[:, None], other=0.0)
        dh = tl.load(dh_ptr + rows.to(tl.int64)[:, None] * (2 * F) + offs_m_ld[None, :],
                     mask=rmask[:, None], other=0.0)
        acc = mma(tl.trans(dh), xt, acc, UPCAST, IEEE)

    # Row m of the product is dW1[e][m] for m < F and dW3[e][m - F] above: two masked stores, each
    # element written once (a tile may straddle the halves when BLOCK_M does not divide F).
    out = acc.to(dw1_ptr.dtype.element_ty)
    nmask = (offs_n < D)[None, :]
    is_up = offs_m >= F
    row = tl.where(is_up, offs_m - F, offs_m)
    out_off = expert.to(tl.int64) * F * D + row[:, None] * D + offs_n[None, :]
    tl.store(dw1_ptr + out_off, out, mask=(offs_m < F)[:, None] & nmask)
    tl.store(dw3_ptr + out_off, out, mask=(is_up & (offs_m < 2 * F))[:, None] & nmask)


@triton.jit
def _dw2_kernel(
    dy_ptr,  # (T, D)
    sa_ptr,  # (N, F) s * A from the dH epilogue
    dw2_ptr,  # (E, D, F) out
    sorted_slot_ptr,
    offsets_ptr,
    K_TOP,
    D,
    F,
    BLOCK_M: tl.constexpr,  # over D
    BLOCK_N: tl.constexpr,  # over F
    BLOCK_K: tl.constexpr,  # over the expert's rows
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    expert, offs_m, offs_n, start, end = expert_tile(tl.program_id(0), D, F, offsets_ptr, BLOCK_M, BLOCK_N)
    offs_m_ld = offs_m % D
    offs_n_ld = offs_n % F
    dtype = dw2_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        rmask = rows < end
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        tok = (slot // K_TOP).to(tl.int64)
        dyt = tl.load(dy_ptr + tok[:, None] * D + offs_m_ld[None, :], mask=rmask[:, None], other=0.0)
        sa_ptrs = sa_ptr + rows.to(tl.int64)[:, None] * F + offs_n_ld[None, :]
        sa = tl.load(sa_ptrs, mask=rmask[:, None], other=0.0)
        acc = mma(tl.trans(dyt), sa, acc, UPCAST, IEEE)

    out_off = expert.to(tl.int64) * D * F + offs_m[:, None] * F + offs_n[None, :]
    omask = (offs_m < D)[:, None] & (offs_n < F)[None, :]
    tl.store(dw2_ptr + out_off, acc.to(dtype), mask=omask)


def dh(
    dy_TD: torch.Tensor,
    w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    cfg: TileConfig,
    tiles: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dA' = dy_gathered @ w2[e] with the SwiGLU backward and the routing-weight grad as epilogue.

    Args:
        dy_TD: (T, D); w2_EDF: (E, D, F); h_N2F: (N, 2F) [gate | up], expert-sorted rows; all one
            dtype. topk_weights_TK: (T, K) fp32. sorted_slot_N: (N,) int32 and offsets_E1: (E+1,)
            int32 from ``routing.sort_by_expert``. cfg: the ``dh`` tiles. tiles: a
            ``routing.tile_table`` of ``cfg.block_m`` to reuse, or None.

    Returns:
        dh_N2F: (N, 2F) [dgate | dup] in h's dtype, expert-sorted rows.
        ds_TK: (T, K) fp32 gradient of the routing weights.
        sa_NF: (N, F) s * silu(g) * up in h's dtype, expert-sorted rows: the operand of dW2,
            written here where A is at hand anyway.
    """
    T, K = topk_weights_TK.shape
    D, F = w2_EDF.shape[1:]
    N = T * K
    num_f_tiles = triton.cdiv(F, cfg.block_n)
    dh_N2F = torch.empty_like(h_N2F)
    sa_NF = torch.empty((N, F), device=h_N2F.device, dtype=h_N2F.dtype)
    ds_part_PN = torch.empty((num_f_tiles, N), device=h_N2F.device, dtype=torch.float32)
    grid, tiles, n_tiles, launch = m_tiled_launch(offsets_E1, N, num_f_tiles, cfg, tiles)
    _dh_kernel[grid](
        dy_TD, w2_EDF, h_N2F, topk_weights_TK, dh_N2F, sa_NF, ds_part_PN, sorted_slot_N, offsets_E1, tiles,
        n_tiles, N, K, D, F,
        EVEN_K=D % cfg.block_k == 0, EPI_SPLIT=cfg.epilogue_split, **launch_flags(h_N2F.dtype), **launch,
    )  # fmt: skip
    # Partials of the F-tiles summed in a fixed order: deterministic.
    return dh_N2F, ds_part_PN.sum(0).view(T, K), sa_NF


def dx_slots(
    dh_N2F: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    cfg: TileConfig,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """dXbuf[slot] = dgate @ w1[e] + dup @ w3[e]: (N, D) in dH's dtype, rows by slot t*K+k.

    dh_N2F: (N, 2F) expert-sorted rows; w1_EFD, w3_EFD: (E, F, D); the rest as in :func:`dh`."""
    N = dh_N2F.shape[0]
    F, D = w1_EFD.shape[1:]
    dxbuf_ND = torch.empty((N, D), device=dh_N2F.device, dtype=dh_N2F.dtype)
    grid, tiles, n_tiles, launch = m_tiled_launch(offsets_E1, N, triton.cdiv(D, cfg.block_n), cfg, tiles)
    _dx_kernel[grid](
        dh_N2F, w1_EFD, w3_EFD, dxbuf_ND, sorted_slot_N, offsets_E1, tiles, n_tiles, D, F,
        EVEN_K=F % cfg.block_k == 0, **launch_flags(dh_N2F.dtype), **launch,
    )  # fmt: skip
    return dxbuf_ND


def dw13(
    x_TD: torch.Tensor,
    dh_N2F: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_experts: int,
    top_k: int,
    cfg: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dW1[e] = dgate_e^T @ x_e and dW3[e] = dup_e^T @ x_e: two (E, F, D) tensors in x's dtype.

    x_TD: (T, D); dh_N2F: (N, 2F) expert-sorted rows; sorted_slot_N (N,) and offsets_E1 (E+1,) int32."""
    D = x_TD.shape[1]
    F = dh_N2F.shape[1] // 2
    E = num_experts
    dw1_EFD = torch.empty((E, F, D), device=x_TD.device, dtype=x_TD.dtype)
    dw3_EFD = torch.empty_like(dw1_EFD)
    _dw13_kernel[(E * triton.cdiv(2 * F, cfg.block_m) * triton.cdiv(D, cfg.block_n),)](
        x_TD, dh_N2F, dw1_EFD, dw3_EFD, sorted_slot_N, offsets_E1,
        top_k, D, F,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **launch_flags(x_TD.dtype), **launch_options(cfg),
    )  # fmt: skip
    return dw1_EFD, dw3_EFD


def dw2(
    dy_TD: torch.Tensor,
    h_N2F: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sa_NF: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_experts: int,
    cfg: TileConfig,
) -> torch.Tensor:
    """dW2[e] = dy_e^T @ (s * silu(g) * u)_e: (E, D, F) in dy's dtype.

    dy_TD: (T, D); sa_NF: (N, F) s * A from :func:`dh`, expert-sorted rows; h_N2F (N, 2F) and
    topk_weights_TK (T, K) give F and K only; sorted_slot_N (N,) and offsets_E1 (E+1,) int32.
    """
    D = dy_TD.shape[1]
    F = h_N2F.shape[1] // 2
    E = num_experts
    K = topk_weights_TK.shape[1]
    dw2_EDF = torch.empty((E, D, F), device=dy_TD.device, dtype=dy_TD.dtype)
    _dw2_kernel[(E * triton.cdiv(D, cfg.block_m) * triton.cdiv(F, cfg.block_n),)](
        dy_TD, sa_NF, dw2_EDF, sorted_slot_N, offsets_E1,
        K, D, F,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **launch_flags(dy_TD.dtype), **launch_options(cfg),
    )  # fmt: skip
    return dw2_EDF


def moe_backward(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    configs: MegaMoEConfigs | None = None,
    write_empty_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward pass. All inputs contiguous: dy_TD and x_TD (T, D), topk_weights_TK (T, K)
    fp32, the weights as in the forward, h_N2F (N, 2F), sorted_slot_N (N,) int32 and offsets_E1
    (E+1,) int32 from :func:`~kernels.moe.mega.forward.moe_forward`; dy, x, weights and H one dtype.
    Empty slots (expert id -1) get zero gradients. ``configs`` None takes
    :func:`~kernels.moe.mega.configs.get_configs`' defaults. Only rows of dy and x with a routed slot
    are read; ``write_empty_rows`` False leaves dx's rows of tokens with none undefined.

    Returns:
        dx_TD (x's dtype), dw1_EFD, dw3_EFD, dw2_EDF (weights' dtype), dtopk_weights_TK (fp32).
    """
    T, K = topk_weights_TK.shape
    E, F, D = w1_EFD.shape
    N = T * K
    if configs is None:
        configs = get_configs(D, F, E, x_TD.dtype)
    gmm = _use_grouped_mm(configs, x_TD)
    if gmm:
        # dy rows in expert order, for cuBLAS (which takes no row index); rows of empty slots (past
        # offsets_E1[E]) belong to no group and stay unwritten.
        dys_ND = gather_sorted_rows(dy_TD, sorted_slot_N, offsets_E1, K)
        dh_N2F, ds_TK, sa_NF = dh_grouped_mm(dys_ND, w2_EDF, h_N2F, topk_weights_TK, sorted_slot_N, offsets_E1)
    else:
        tiles = tile_table(offsets_E1, N, configs.dh.block_m)  # shared with dx when their block_m match
        dh_N2F, ds_TK, sa_NF = dh(dy_TD, w2_EDF, h_N2F, topk_weights_TK, sorted_slot_N, offsets_E1, configs.dh, tiles)
    # Empty slots' rows lie past every expert's tiles: skipped in the sum, zeroed in ds.
    valid_N = valid_slots(sorted_slot_N, offsets_E1)
    if gmm:
        dx_TD = dx_grouped_mm(dh_N2F, w1_EFD, w3_EFD, sorted_slot_N, offsets_E1, valid_N, K, write_empty_rows)
    else:
        if configs.dx.block_m != configs.dh.block_m:
            tiles = None
        dxbuf_ND = dx_slots(dh_N2F, w1_EFD, w3_EFD, sorted_slot_N, offsets_E1, configs.dx, tiles)
        dx_TD = combine_slots(dxbuf_ND, T, K, sorted_slot_N, offsets_E1, valid_N, write_empty_rows)
        del dxbuf_ND
    ds_TK = torch.where(valid_N.view(T, K) != 0, ds_TK, 0.0)
    if gmm:
        ends_E = offsets_E1[1:]
        dw2_EDF = grouped_mm(dys_ND.t(), sa_NF, ends_E)
        del dys_ND, sa_NF
        xs_ND = gather_sorted_rows(x_TD, sorted_slot_N, offsets_E1, K)
        dw1_EFD = grouped_mm(dh_N2F[:, :F].t(), xs_ND, ends_E)
        dw3_EFD = grouped_mm(dh_N2F[:, F:].t(), xs_ND, ends_E)
        return dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, ds_TK
    dw1_EFD, dw3_EFD = dw13(x_TD, dh_N2F, sorted_slot_N, offsets_E1, E, K, configs.dw13)
    del dh_N2F
    dw2_EDF = dw2(dy_TD, h_N2F, topk_weights_TK, sa_NF, sorted_slot_N, offsets_E1, E, configs.dw2)
    return dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, ds_TK


def _use_grouped_mm(configs: MegaMoEConfigs, x_TD: torch.Tensor) -> bool:
    """``configs.grouped_mm_backward`` where ``torch._grouped_mm`` has a kernel for x's dtype: on CUDA
    bf16 only; on CPU (interpreter tests) grouped_mm's loop over the experts stands in."""
    return configs.grouped_mm_backward and (not x_TD.is_cuda or x_TD.dtype == torch.bfloat16)


def dx_grouped_mm(
    dh_N2F: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    valid_N: torch.Tensor,
    top_k: int,
    write_empty_rows: bool = True,
) -> torch.Tensor:
    """dx[t] = sum_k [dgate | dup] @ [w1[e]; w3[e]] of slot t*K+k: one cuBLAS product over 2F into
    expert-sorted rows, then one deterministic gather-sum over k.

    dh_N2F: (N, 2F) expert-sorted rows; w1_EFD, w3_EFD: (E, F, D); valid_N: (N,) int8 from
    ``combine.valid_slots``. Returns (N // top_k, D) in dH's dtype (rows of tokens with no valid
    slot zero, or undefined if not ``write_empty_rows``)."""
    N = dh_N2F.shape[0]
    # One product over the stacked weights instead of one per weight: a single (N, D) buffer is
    # written and read, and the GEMM's reduction is twice as deep.
    w13_E2FD = torch.cat([w1_EFD, w3_EFD], dim=1)
    dx_ND = grouped_mm(dh_N2F, w13_E2FD, offsets_E1[1:])
    del w13_E2FD
    # row_of_slot[sorted_slot[r]] = r: where each (token, k) slot's row landed.
    row_of_slot_N = torch.empty_like(sorted_slot_N).scatter_(
        0, sorted_slot_N.long(), torch.arange(N, device=sorted_slot_N.device, dtype=sorted_slot_N.dtype))
    return sum_over_k(dx_ND, N // top_k, top_k, valid_N, row_of_slot_N=row_of_slot_N, write_empty_rows=write_empty_rows)


def dh_grouped_mm(
    dys_ND: torch.Tensor,
    w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`dh` returns, with dA' = dy_sorted @ w2[e] by cuBLAS and the SwiGLU backward as
    a separate elementwise pass (:func:`_swiglu_bwd_kernel`). dys_ND: (N, D) dy rows in expert
    order; the rest as in :func:`dh`."""
    N, F = h_N2F.shape[0], h_N2F.shape[1] // 2
    E = w2_EDF.shape[0]
    T, K = topk_weights_TK.shape
    da_NF = grouped_mm(dys_ND, w2_EDF, offsets_E1[1:])
    dh_N2F = torch.empty_like(h_N2F)
    sa_NF = torch.empty((N, F), device=h_N2F.device, dtype=h_N2F.dtype)
    ds_N = torch.zeros(N, device=h_N2F.device, dtype=torch.float32)
    block_r, block_f = (16, 32) if interpreting() else (16, 128)
    _swiglu_bwd_kernel[(triton.cdiv(N, block_r),)](
        da_NF, h_N2F, topk_weights_TK, dh_N2F, sa_NF, ds_N, sorted_slot_N, offsets_E1, E, F,
        BLOCK_R=block_r, BLOCK_F=block_f, num_warps=4,
    )  # fmt: skip
    return dh_N2F, ds_N.view(T, K), sa_NF
