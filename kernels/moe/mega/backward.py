"""Backward kernels of the mega-MoE op.

With g, u the gate/up halves of H (saved by the forward, expert-sorted rows r, slot = sorted_slot[r]):

    dA'[r]  = dy[tok(r)] @ w2[e]                                  (_dh_kernel, M-tiled)
    ds[slot] = rowsum(dA'[r] * silu(g) * u)                       (same epilogue, per-F-tile partials)
    dgate   = s * dA' * u * silu'(g),  dup = s * dA' * silu(g)    (same epilogue, stored as dH)
    dXbuf[slot] = dgate @ w1[e] + dup @ w3[e];  dx[t] = sum_k dXbuf[t*K+k]   (_dx_kernel)
    [dW1[e]; dW3[e]] = [dgate | dup]_e^T @ x_e                    (_dw13_kernel, one GEMM over 2F)
    dW2[e] = dy_e^T @ (s * silu(g) * u)_e                          (_dw2_kernel)

In these Triton kernels dy and x rows are gathered by token index inside the loads. s * A for dW2 is written by the dH epilogue (an N x F buffer alive only during the
backward): rebuilding it from H inside the dW2 load (``MegaMoEConfigs.dw2_from_h``) recomputes the
SwiGLU once per D-tile, which made dW2 2.3x slower on the H200 (2.8 ms vs 1.2 ms at 30B).

The weight-gradient kernels are grouped GEMMs whose reduction runs over the variable row range of
one expert: a grid of E * m_tiles * n_tiles programs, expert slowest; an expert with no rows
stores exact zeros. On the H200 they reach only ~330 TFLOP/s (short K loops of ~1024 rows per
expert), so for bf16 the default (``MegaMoEConfigs.wgrad = "grouped_mm"``) computes the weight
gradients with cuBLAS's K-grouped ``torch._grouped_mm`` instead, on x and dy rows copied into expert
order inside the backward (transient, 0.5 GB each at the 30B shape; nothing more is saved for
backward): 1.0 ms faster per layer at 30B, 5 ms at 235B (BENCHMARKS Run 6). The same sorted dy copy
then also feeds dA' = dy_e @ w2[e] through cuBLAS (``MegaMoEConfigs.dh_gemm = "grouped_mm"``), with
the dh kernel's SwiGLU-backward epilogue run as its own elementwise kernel
(:func:`_swiglu_bwd_kernel`): 0.3-0.5 ms faster at 30B, 1 ms at 235B (Run 7). The fused Triton
kernels remain the fp32 path and the ``"triton"`` choices.
Every sum has a fixed order (no float atomics), so the backward is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.grouped_mm import grouped_mm
from kernels.moe.combine import sum_over_k, valid_slots
from kernels.triton_utils import expert_tile, launch_flags, launch_options, m_tiled_launch, mma, num_work, tile_rows
from kernels.moe.mega.configs import MegaMoEConfigs, TileConfig
from kernels.triton_utils import interpreting
from kernels.moe.routing import max_tiles, tile_table


@triton.jit
def _dh_kernel(
    dy_ptr,  # (T, D)
    w2_ptr,  # (E, D, F)
    h_ptr,  # (N, 2F) [gate | up]
    s_ptr,  # (N,) fp32 by slot
    dh_ptr,  # (N, 2F) out: [dgate | dup]
    sa_ptr,  # (N, F) out: s * silu(g) * u, the B operand of dW2 (unused unless STORE_SA)
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
    STORE_SA: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    NUM_PROGS,
    PERSISTENT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    num_n = tl.cdiv(F, BLOCK_N)
    for work in tl.range(tl.program_id(0), num_work(table_ptr, num_tiles, num_n), NUM_PROGS, flatten=PERSISTENT):
        pid_m = work // num_n
        pid_n = work % num_n
        expert, rows, rmask, _ = tile_rows(table_ptr, offsets_ptr, num_tiles, pid_m, BLOCK_M)

        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        tok = (slot // K_TOP).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n_ld = offs_n % F
        offs_k = tl.arange(0, BLOCK_K)
        dy_ptrs = dy_ptr + tok[:, None] * D + offs_k[None, :]
        w_ptrs = w2_ptr + expert.to(tl.int64) * D * F + offs_k[:, None] * F + offs_n_ld[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(dy_ptrs)
                b = tl.load(w_ptrs)
            else:
                kmask = offs_k + k0 < D
                a = tl.load(dy_ptrs, mask=kmask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
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
            ds_part = _dh_epilogue(acc_lo, rows64, rmask, s, offs_lo, h_ptr, dh_ptr, sa_ptr, F, STORE_SA)
            ds_part += _dh_epilogue(
                acc_hi, rows64, rmask, s, offs_lo + BLOCK_N // 2, h_ptr, dh_ptr, sa_ptr, F, STORE_SA
            )
        else:
            ds_part = _dh_epilogue(acc, rows64, rmask, s, offs_n, h_ptr, dh_ptr, sa_ptr, F, STORE_SA)
        # Partial ds of this F-tile; the launcher sums the partials in a fixed order.
        tl.store(ds_part_ptr + pid_n * N + slot, ds_part, mask=rmask)


@triton.jit
def _dh_epilogue(acc, rows64, rmask, s, offs_n, h_ptr, dh_ptr, sa_ptr, F, STORE_SA: tl.constexpr):
    """SwiGLU backward of one (rows x offs_n) tile of dA' = acc; returns its part of ds per row."""
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
    if STORE_SA:
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
        ds += _dh_epilogue(da, rows64, rmask, s, offs_f, h_ptr, dh_ptr, sa_ptr, F, True)
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
        pid_m = work // num_n
        pid_n = work % num_n
        expert, rows, rmask, safe_rows = tile_rows(table_ptr, offsets_ptr, num_tiles, pid_m, BLOCK_M)

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n_ld = offs_n % D
        offs_k = tl.arange(0, BLOCK_K)
        dg_ptrs = dh_ptr + safe_rows.to(tl.int64)[:, None] * (2 * F) + offs_k[None, :]
        w_off = expert.to(tl.int64) * F * D + offs_k[:, None] * D + offs_n_ld[None, :]
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off

        # One accumulator for both halves: dX = [dgate | dup] @ [w1[e]; w3[e]].
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            if EVEN_K:
                dg = tl.load(dg_ptrs)
                du = tl.load(dg_ptrs + F)
                b1 = tl.load(w1_ptrs)
                b3 = tl.load(w3_ptrs)
            else:
                kmask = offs_k + k0 < F
                dg = tl.load(dg_ptrs, mask=kmask[None, :], other=0.0)
                du = tl.load(dg_ptrs + F, mask=kmask[None, :], other=0.0)
                b1 = tl.load(w1_ptrs, mask=kmask[:, None], other=0.0)
                b3 = tl.load(w3_ptrs, mask=kmask[:, None], other=0.0)
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
    # height. It measured as fast as two accumulators sharing x (BENCHMARKS Run 5); the larger
    # tiles it allows were slower there.
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
    h_ptr,  # (N, 2F) [gate | up] (read if FROM_H)
    s_ptr,  # (N,) fp32 by slot (read if FROM_H)
    sa_ptr,  # (N, F) s * A from the dH epilogue (read unless FROM_H)
    dw2_ptr,  # (E, D, F) out
    sorted_slot_ptr,
    offsets_ptr,
    K_TOP,
    D,
    F,
    BLOCK_M: tl.constexpr,  # over D
    BLOCK_N: tl.constexpr,  # over F
    BLOCK_K: tl.constexpr,  # over the expert's rows
    FROM_H: tl.constexpr,
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
        if FROM_H:
            # s * A rebuilt from H in the load (no N x F buffer, but the SwiGLU is recomputed
            # once per D-tile): A is rounded to the activation dtype as in the forward.
            h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * (2 * F) + offs_n_ld[None, :]
            g = tl.load(h_ptrs, mask=rmask[:, None], other=0.0).to(tl.float32)
            u = tl.load(h_ptrs + F, mask=rmask[:, None], other=0.0).to(tl.float32)
            s = tl.load(s_ptr + slot, mask=rmask, other=0.0)
            act = (g * tl.sigmoid(g) * u).to(dtype).to(tl.float32)
            sa = (act * s[:, None]).to(dtype)
        else:
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
    store_sa: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dA' = dy_gathered @ w2[e] with the SwiGLU backward and the routing-weight grad as epilogue.

    Returns:
        dh_N2F: (N, 2F) [dgate | dup] in h's dtype, expert-sorted rows.
        ds_TK: (T, K) fp32 gradient of the routing weights.
        sa_NF: (N, F) s * silu(g) * up in h's dtype, expert-sorted rows (None unless store_sa):
            the operand of dW2, written here where A is at hand anyway.
    """
    T, K = topk_weights_TK.shape
    E, D, F = w2_EDF.shape
    N = T * K
    n_tiles = max_tiles(N, E, cfg.block_m)
    if tiles is None:
        tiles = tile_table(offsets_E1, N, cfg.block_m)
    num_f_tiles = triton.cdiv(F, cfg.block_n)
    dh_N2F = torch.empty_like(h_N2F)
    sa_NF = torch.empty((N, F), device=h_N2F.device, dtype=h_N2F.dtype) if store_sa else None
    ds_part_PN = torch.empty((num_f_tiles, N), device=h_N2F.device, dtype=torch.float32)
    grid, loop = m_tiled_launch(n_tiles, num_f_tiles, cfg, h_N2F.device)
    _dh_kernel[grid](
        dy_TD, w2_EDF, h_N2F, topk_weights_TK, dh_N2F, sa_NF if store_sa else dh_N2F, ds_part_PN,
        sorted_slot_N, offsets_E1, tiles,
        n_tiles, N, K, D, F,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=D % cfg.block_k == 0,
        STORE_SA=store_sa, EPI_SPLIT=cfg.epilogue_split, **launch_flags(h_N2F.dtype), **launch_options(cfg), **loop,
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
    """dXbuf[slot] = dgate @ w1[e] + dup @ w3[e]: (N, D) in dH's dtype, rows by slot t*K+k."""
    N = dh_N2F.shape[0]
    E, F, D = w1_EFD.shape
    n_tiles = max_tiles(N, E, cfg.block_m)
    if tiles is None:
        tiles = tile_table(offsets_E1, N, cfg.block_m)
    dxbuf_ND = torch.empty((N, D), device=dh_N2F.device, dtype=dh_N2F.dtype)
    grid, loop = m_tiled_launch(n_tiles, triton.cdiv(D, cfg.block_n), cfg, dh_N2F.device)
    _dx_kernel[grid](
        dh_N2F, w1_EFD, w3_EFD, dxbuf_ND, sorted_slot_N, offsets_E1, tiles,
        n_tiles, D, F,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=F % cfg.block_k == 0,
        **launch_flags(dh_N2F.dtype), **launch_options(cfg), **loop,
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
    """dW1[e] = dgate_e^T @ x_e and dW3[e] = dup_e^T @ x_e: two (E, F, D) tensors in x's dtype."""
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
    sa_NF: torch.Tensor | None,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    num_experts: int,
    cfg: TileConfig,
) -> torch.Tensor:
    """dW2[e] = dy_e^T @ (s * silu(g) * u)_e: (E, D, F) in dy's dtype.

    Reads s * A from ``sa_NF`` (from :func:`dh`), or, if it is None, rebuilds it from H and s.
    """
    D = dy_TD.shape[1]
    F = h_N2F.shape[1] // 2
    E = num_experts
    K = topk_weights_TK.shape[1]
    dw2_EDF = torch.empty((E, D, F), device=dy_TD.device, dtype=dy_TD.dtype)
    _dw2_kernel[(E * triton.cdiv(D, cfg.block_m) * triton.cdiv(F, cfg.block_n),)](
        dy_TD, h_N2F, topk_weights_TK, h_N2F if sa_NF is None else sa_NF, dw2_EDF, sorted_slot_N, offsets_E1,
        K, D, F,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FROM_H=sa_NF is None,
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
    configs: MegaMoEConfigs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward pass. All inputs contiguous, dy in x's dtype, routing weights fp32.
    Empty slots (expert id -1) get zero gradients.

    Returns:
        dx_TD (x's dtype), dw1_EFD, dw3_EFD, dw2_EDF (weights' dtype), dtopk_weights_TK (fp32).
    """
    T, K = topk_weights_TK.shape
    E = w1_EFD.shape[0]
    N = T * K
    gmm_wgrad = use_grouped_mm(configs.wgrad, "wgrad", x_TD) and not configs.dw2_from_h
    gmm_dh = use_grouped_mm(configs.dh_gemm, "dh_gemm", x_TD)
    tok_N = (sorted_slot_N // K).long()
    # dy rows in expert order, for cuBLAS (which takes no row index); rows of empty slots (past
    # offsets_E1[E]) belong to no group.
    dys_ND = dy_TD.index_select(0, tok_N) if gmm_wgrad or gmm_dh else None
    tiles = None  # the dh kernel's tile table, shared with the dx kernel when their block_m match
    if gmm_dh:
        dh_N2F, ds_TK, sa_NF = dh_grouped_mm(dys_ND, w2_EDF, h_N2F, topk_weights_TK, sorted_slot_N, offsets_E1)
    else:
        tiles = tile_table(offsets_E1, N, configs.dh.block_m)
        dh_N2F, ds_TK, sa_NF = dh(
            dy_TD, w2_EDF, h_N2F, topk_weights_TK, sorted_slot_N, offsets_E1, configs.dh, tiles,
            store_sa=not configs.dw2_from_h,
        )  # fmt: skip
    # Empty slots' rows lie past every expert's tiles: skipped in the sum, zeroed in ds.
    valid_N = valid_slots(sorted_slot_N, offsets_E1)
    if use_grouped_mm(configs.dx_gemm, "dx_gemm", x_TD):
        dx_TD = dx_grouped_mm(dh_N2F, w1_EFD, w3_EFD, sorted_slot_N, offsets_E1, valid_N, K)
    else:
        if configs.dx.block_m != configs.dh.block_m:
            tiles = None
        dxbuf_ND = dx_slots(dh_N2F, w1_EFD, w3_EFD, sorted_slot_N, offsets_E1, configs.dx, tiles)
        dx_TD = sum_over_k(dxbuf_ND, T, K, valid_N)
        del dxbuf_ND
    ds_TK = torch.where(valid_N.view(T, K) != 0, ds_TK, 0.0)
    if gmm_wgrad:
        ends_E = offsets_E1[1:]
        dw2_EDF = grouped_mm(dys_ND.t(), sa_NF, ends_E)
        del dys_ND, sa_NF
        F = h_N2F.shape[1] // 2
        xs_ND = x_TD.index_select(0, tok_N)
        dw1_EFD = grouped_mm(dh_N2F[:, :F].t(), xs_ND, ends_E)
        dw3_EFD = grouped_mm(dh_N2F[:, F:].t(), xs_ND, ends_E)
        return dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, ds_TK
    del dys_ND
    dw1_EFD, dw3_EFD = dw13(x_TD, dh_N2F, sorted_slot_N, offsets_E1, E, K, configs.dw13)
    del dh_N2F
    dw2_EDF = dw2(dy_TD, h_N2F, topk_weights_TK, sa_NF, sorted_slot_N, offsets_E1, E, configs.dw2)
    return dx_TD, dw1_EFD, dw3_EFD, dw2_EDF, ds_TK


def dx_grouped_mm(
    dh_N2F: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    valid_N: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """dx[t] = sum_k (dgate @ w1[e] + dup @ w3[e]) of slot t*K+k, the two products by cuBLAS into
    expert-sorted rows, then one deterministic gather-sum over k of both buffers."""
    N, F = dh_N2F.shape[0], dh_N2F.shape[1] // 2
    ends_E = offsets_E1[1:]
    dxg_ND = grouped_mm(dh_N2F[:, :F], w1_EFD, ends_E)
    dxu_ND = grouped_mm(dh_N2F[:, F:], w3_EFD, ends_E)
    # row_of_slot[sorted_slot[r]] = r: where each (token, k) slot's row landed.
    row_of_slot_N = torch.empty_like(sorted_slot_N).scatter_(
        0, sorted_slot_N.long(), torch.arange(N, device=sorted_slot_N.device, dtype=sorted_slot_N.dtype))
    return sum_over_k(dxg_ND, N // top_k, top_k, valid_N, row_of_slot_N=row_of_slot_N, buf2_ND=dxu_ND)


def dh_grouped_mm(
    dys_ND: torch.Tensor,
    w2_EDF: torch.Tensor,
    h_N2F: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`dh` returns, with dA' = dy_sorted @ w2[e] by cuBLAS and the SwiGLU backward as
    a separate elementwise pass (:func:`_swiglu_bwd_kernel`)."""
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


def use_grouped_mm(choice: str, name: str, x_TD: torch.Tensor) -> bool:
    """``choice == "grouped_mm"`` where ``torch._grouped_mm`` has a kernel for x's dtype."""
    if choice == "triton":
        return False
    if choice != "grouped_mm":
        raise ValueError(f"MegaMoEConfigs.{name} must be 'triton' or 'grouped_mm', got {choice!r}")
    # On CPU (interpreter tests) grouped_mm's loop over the experts stands in where torch has no
    # kernel; on CUDA torch._grouped_mm runs bf16 only.
    return not x_TD.is_cuda or x_TD.dtype == torch.bfloat16
