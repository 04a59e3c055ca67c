"""Forward kernels of the mega-MoE op: gathered gate/up GEMM with SwiGLU, weighted down GEMM.

    H_N2F[r]   = [x[tok(r)] @ w1[e]^T | x[tok(r)] @ w3[e]^T]        (expert-sorted rows r)
    A_NF[r]    = silu(H gate) * (H up)
    Ybuf[slot] = s[slot] * A_NF[r] @ w2[e]^T                         (slot = sorted_slot[r])
    y[t]       = sum_k Ybuf[t*K + k]                                 (fp32, fixed order)

Both GEMMs are grouped over experts by the tile table of :mod:`kernels.common.routing`: a 1-D
grid of ``max_tiles * n_tiles`` programs, program -> (M-tile, N-tile) with the N-tile fastest so
that programs running together share their gathered A rows and their expert's weights in L2.
x rows are gathered by token index inside the A-operand load; no N x D copy of x is made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.routing import sort_by_expert, tile_table
from kernels.common.tiles import TileConfig, m_tiled_launch
from kernels.common.triton_utils import launch_flags, load_k, m_tile_rows, mma, n_tile_cols, num_work
from kernels.moe.combine import combine_slots
from kernels.moe.mega.configs import MegaMoEConfigs, get_configs


@triton.jit
def _gate_up_kernel(
    x_ptr,  # (T, D)
    w1_ptr,  # (E, F, D)
    w3_ptr,  # (E, F, D)
    h_ptr,  # (N, 2F) out: [gate | up], expert-sorted rows
    a_ptr,  # (N, F) out: silu(gate) * up
    sorted_slot_ptr,  # (N,) int32
    offsets_ptr,  # (E+1,) int32
    table_ptr,  # (2, num_tiles) int32
    num_tiles,
    K_TOP,
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
    num_n = tl.cdiv(F, BLOCK_N)
    for work in tl.range(tl.program_id(0), num_work(table_ptr, num_tiles, num_n), NUM_PROGS, flatten=PERSISTENT):
        pid_n, expert, rows, rmask, _ = m_tile_rows(work, num_n, table_ptr, offsets_ptr, num_tiles, BLOCK_M)
        # Rows past the expert's end read token 0 (a valid row) and are dropped at the store, so the
        # K loop needs no row mask.
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        tok = (slot // K_TOP).to(tl.int64)
        offs_n, offs_n_ld, offs_k = n_tile_cols(pid_n, F, BLOCK_N, BLOCK_K)
        x_ptrs = x_ptr + tok[:, None] * D + offs_k[None, :]
        w_off = expert.to(tl.int64) * F * D + offs_n_ld[None, :] * D + offs_k[:, None]  # (BK, BN)
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = load_k(x_ptrs, offs_k, k0, D, EVEN_K, 1)
            b1 = load_k(w1_ptrs, offs_k, k0, D, EVEN_K, 0)
            b3 = load_k(w3_ptrs, offs_k, k0, D, EVEN_K, 0)
            acc_g = mma(a, b1, acc_g, UPCAST, IEEE)
            acc_u = mma(a, b3, acc_u, UPCAST, IEEE)
            x_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K
            w3_ptrs += BLOCK_K

        dtype = h_ptr.dtype.element_ty
        gate = acc_g.to(dtype)
        up = acc_u.to(dtype)
        rows64 = rows.to(tl.int64)
        smask = rmask[:, None] & (offs_n < F)[None, :]
        h_ptrs = h_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
        tl.store(h_ptrs, gate, mask=smask)
        tl.store(h_ptrs + F, up, mask=smask)
        # A from the rounded gate/up, exactly what the backward recomputes from H.
        g = gate.to(tl.float32)
        act = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(a_ptr + rows64[:, None] * F + offs_n[None, :], act.to(dtype), mask=smask)


@triton.jit
def _down_kernel(
    a_ptr,  # (N, F) expert-sorted rows
    w2_ptr,  # (E, D, F)
    s_ptr,  # (N,) fp32 routing weights by slot
    ybuf_ptr,  # (N, D) out: by slot
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
        a_ptrs = a_ptr + safe_rows.to(tl.int64)[:, None] * F + offs_k[None, :]
        w_ptrs = w2_ptr + expert.to(tl.int64) * D * F + offs_n_ld[None, :] * F + offs_k[:, None]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            a = load_k(a_ptrs, offs_k, k0, F, EVEN_K, 1)
            b = load_k(w_ptrs, offs_k, k0, F, EVEN_K, 0)
            acc = mma(a, b, acc, UPCAST, IEEE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        s = tl.load(s_ptr + slot, mask=rmask, other=0.0)
        out = acc * s[:, None]
        smask = rmask[:, None] & (offs_n < D)[None, :]
        y_ptrs = ybuf_ptr + slot.to(tl.int64)[:, None] * D + offs_n[None, :]
        tl.store(y_ptrs, out.to(ybuf_ptr.dtype.element_ty), mask=smask)


def gate_up(
    x_TD: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    top_k: int,
    cfg: TileConfig,
    tiles: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered gate/up GEMM with SwiGLU epilogue.

    Args:
        x_TD: (T, D) activations; w1_EFD, w3_EFD: (E, F, D), x's dtype.
        sorted_slot_N: (N,) int32 and offsets_E1: (E+1,) int32 from ``routing.sort_by_expert``.
        top_k: K (N = T*K). cfg: the ``gate_up`` tiles. tiles: a ``routing.tile_table`` of
            ``cfg.block_m`` to reuse, or None.

    Returns:
        h_N2F: (N, 2F) [gate | up] in x's dtype, expert-sorted rows.
        a_NF: (N, F) silu(gate) * up in x's dtype, expert-sorted rows.
    """
    T, D = x_TD.shape
    F = w1_EFD.shape[1]
    N = T * top_k
    h_N2F = torch.empty((N, 2 * F), device=x_TD.device, dtype=x_TD.dtype)
    a_NF = torch.empty((N, F), device=x_TD.device, dtype=x_TD.dtype)
    grid, tiles, n_tiles, launch = m_tiled_launch(offsets_E1, N, triton.cdiv(F, cfg.block_n), cfg, tiles)
    _gate_up_kernel[grid](
        x_TD, w1_EFD, w3_EFD, h_N2F, a_NF, sorted_slot_N, offsets_E1, tiles, n_tiles, top_k, D, F,
        EVEN_K=D % cfg.block_k == 0, **launch_flags(x_TD.dtype), **launch,
    )  # fmt: skip
    return h_N2F, a_NF


def down(
    a_NF: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    cfg: TileConfig,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Down GEMM whose epilogue scales by the routing weight and writes each row to its slot.

    Args:
        a_NF: (N, F) expert-sorted rows; w2_EDF: (E, D, F), a's dtype; topk_weights_TK: (T, K) fp32.
        sorted_slot_N, offsets_E1, cfg, tiles: as in :func:`gate_up` (cfg: the ``down`` tiles).

    Returns:
        ybuf_ND: (N, D) in a's dtype, row t*K+k holding s[t,k] * w2[e] @ A[row of (t, k)].
    """
    N, F = a_NF.shape
    D = w2_EDF.shape[1]
    ybuf_ND = torch.empty((N, D), device=a_NF.device, dtype=a_NF.dtype)
    grid, tiles, n_tiles, launch = m_tiled_launch(offsets_E1, N, triton.cdiv(D, cfg.block_n), cfg, tiles)
    _down_kernel[grid](
        a_NF, w2_EDF, topk_weights_TK, ybuf_ND, sorted_slot_N, offsets_E1, tiles, n_tiles, D, F,
        EVEN_K=F % cfg.block_k == 0, **launch_flags(a_NF.dtype), **launch,
    )  # fmt: skip
    return ybuf_ND


def moe_forward(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w3_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    configs: MegaMoEConfigs | None = None,
    write_empty_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward pass. Inputs contiguous: x_TD (T, D), topk_ids_TK (T, K) int32/int64,
    topk_weights_TK (T, K) fp32, w1_EFD and w3_EFD (E, F, D), w2_EDF (E, D, F) in x's dtype. Expert
    ids of -1 mark empty slots (expert parallelism's padding), which contribute nothing. ``configs``
    None takes :func:`~kernels.moe.mega.configs.get_configs`' defaults. Only rows of x with a
    routed slot are read; ``write_empty_rows`` False leaves y's rows of tokens with none undefined.

    Returns:
        y_TD: (T, D) in x's dtype.
        h_N2F: (N, 2F) [gate | up] pre-activations, expert-sorted rows, x's dtype (for backward).
        sorted_slot_N: (N,) int32, offsets_E1: (E+1,) int32 (see ``routing.sort_by_expert``).
    """
    T, K = topk_ids_TK.shape
    E, F, D = w1_EFD.shape
    if configs is None:
        configs = get_configs(D, F, E, x_TD.dtype)
    sorted_slot_N, offsets_E1 = sort_by_expert(topk_ids_TK, E)
    tiles = tile_table(offsets_E1, T * K, configs.gate_up.block_m)
    h_N2F, a_NF = gate_up(x_TD, w1_EFD, w3_EFD, sorted_slot_N, offsets_E1, K, configs.gate_up, tiles)
    if configs.down.block_m != configs.gate_up.block_m:
        tiles = None
    ybuf_ND = down(a_NF, w2_EDF, topk_weights_TK, sorted_slot_N, offsets_E1, configs.down, tiles)
    y_TD = combine_slots(ybuf_ND, T, K, sorted_slot_N, offsets_E1, write_empty_rows=write_empty_rows)
    return y_TD, h_N2F, sorted_slot_N, offsets_E1
