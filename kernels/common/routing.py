"""Routing metadata of the grouped expert GEMMs: expert-sorted order and a static-size tile schedule.

Everything here stays on the device and has shapes fixed by (T, K, E, block_m) alone, so there is
no device-to-host sync and the op traces under ``torch.compile(fullgraph=True)``.

Names: N = T*K routed rows; slot n = t*K + k is the (token, k) pair in ``topk_ids_TK.view(-1)``;
"row" r is a position in expert-sorted order, the order in which the GEMMs walk the routed rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.triton_utils import interpreting


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable expert-sorted order of the routed slots and per-expert row offsets.

    Args:
        topk_ids_TK: (T, K) int32/int64 expert ids in [0, E), or -1 for an empty slot (expert
            parallelism's padding): empty slots sort after every expert's rows, past offsets_E1[E],
            so no tile covers them.
        num_experts: E.

    Returns:
        sorted_slot_N: (N,) int32; ``sorted_slot_N[r]`` is the slot t*K+k of row r. Rows of one
            expert are contiguous and keep slot order (stable sort), so results do not depend on
            the sort's tie-breaking.
        offsets_E1: (E+1,) int32 exclusive prefix sum of the per-expert counts; rows of expert e
            are ``offsets_E1[e] : offsets_E1[e+1]``; counts are ``offsets_E1.diff()``.
    """
    ids_N = topk_ids_TK.reshape(-1).to(torch.int32)
    ids_N = torch.where(ids_N < 0, num_experts, ids_N)
    sorted_ids_N, sorted_slot_N = torch.sort(ids_N, stable=True)
    # searchsorted on the sorted ids gives the offsets directly, without atomics (bincount would
    # also need a sync to size its output).
    bounds_E1 = torch.arange(num_experts + 1, device=ids_N.device, dtype=torch.int32)
    offsets_E1 = torch.searchsorted(sorted_ids_N, bounds_E1)
    return sorted_slot_N.to(torch.int32), offsets_E1.to(torch.int32)


def num_real_tiles(table: torch.Tensor) -> torch.Tensor:
    """The count stored after a :func:`tile_table` (a 1-element view; tests and debugging)."""
    return table.view(-1).as_strided((1,), (1,), table.storage_offset() + table.numel())


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the M-tiles: sum_e ceil(c_e / BM) <= N // BM + E for any counts c_e."""
    return num_rows // block_m + num_experts


@triton.jit
def _tile_table_kernel(
    offsets_ptr,  # (E+1,) int32
    table_ptr,  # (2, max_tiles) int32 out: [expert or -1; first row]
    E,
    num_tiles,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    e = tl.arange(0, E_POW2)
    emask = e < E
    start = tl.load(offsets_ptr + e, mask=emask, other=0)
    end = tl.load(offsets_ptr + e + 1, mask=emask, other=0)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_begin = tile_end - tiles

    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # The expert of tile t is the number of experts whose tiles all lie before t. Padding experts
    # (e >= E) have zero tiles, so they only count for surplus tiles, which then get expert >= E.
    expert = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
    sel = e[None, :] == expert[:, None]
    first_tile = tl.sum(tl.where(sel, tile_begin[None, :], 0), axis=1)
    first_row = tl.sum(tl.where(sel, start[None, :], 0), axis=1)
    row = first_row + (t - first_tile) * BLOCK_M
    valid = expert < E
    tmask = t < num_tiles
    tl.store(table_ptr + t, tl.where(valid, expert, -1), mask=tmask)
    tl.store(table_ptr + num_tiles + t, tl.where(valid, row, 0), mask=tmask)
    if tl.program_id(0) == 0:
        # The number of real tiles, after the table: the GEMMs loop over exactly these.
        tl.store(table_ptr + 2 * num_tiles, tl.sum(tiles, axis=0))


def tile_table(offsets_E1: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """Static-size schedule of the M-tiles of a grouped GEMM over expert-sorted rows.

    Args:
        offsets_E1: (E+1,) int32 from :func:`sort_by_expert`.
        num_rows: N.
        block_m: rows per tile.

    Returns:
        (2, N // block_m + E) int32. Column i is tile i: ``[0, i]`` its expert (-1 for surplus
        tiles, whose programs exit at once) and ``[1, i]`` its first row; the tile covers rows
        ``[1, i] : min([1, i] + block_m, offsets_E1[e + 1])``. Tiles are ordered by expert.
        The storage holds one more int32 right after the table, the number of real tiles, which the
        GEMM kernels read at ``table_ptr + 2 * num_tiles`` (so a persistent grid loops over real
        tiles only, with no host sync).
    """
    num_experts = offsets_E1.numel() - 1
    num_tiles = max_tiles(num_rows, num_experts, block_m)
    storage = torch.empty(2 * num_tiles + 1, device=offsets_E1.device, dtype=torch.int32)
    table = storage[: 2 * num_tiles].view(2, num_tiles)
    block_t = 32
    _tile_table_kernel[(triton.cdiv(num_tiles, block_t),)](
        offsets_E1,
        storage,
        num_experts,
        num_tiles,
        BLOCK_M=block_m,
        E_POW2=triton.next_power_of_2(num_experts),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return table


@triton.jit
def _gather_sorted_rows_kernel(
    src_ptr,  # (T, D)
    sorted_slot_ptr,  # (N,) int32 slot t*K+k of each expert-sorted row
    end_ptr,  # pointer to offsets_E1[E]: rows from here on are empty slots'
    out_ptr,  # (N, D) out
    K_TOP,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_R
    end = tl.load(end_ptr)
    if first < end:
        r = first + tl.arange(0, BLOCK_R)
        rmask = r < end
        tok = (tl.load(sorted_slot_ptr + r, mask=rmask, other=0) // K_TOP).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d < D)[None, :]
        vals = tl.load(src_ptr + tok[:, None] * D + d[None, :], mask=mask)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :], vals, mask=mask)


def gather_sorted_rows(src_TD: torch.Tensor, sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor,
                       top_k: int) -> torch.Tensor:
    """Each expert-sorted row's token row: ``src_TD.index_select(0, sorted_slot_N // top_k)`` for the
    rows before ``offsets_E1[E]``, the operand layout of a grouped GEMM that takes no row index.
    The rows of empty slots (from ``offsets_E1[E]`` on) are left unwritten: no group reads them, and
    under expert parallelism they are half the receive buffer at the default capacity.

    src_TD: (T, D) contiguous, any dtype (FP8 as a byte view works too). Returns (N, D)."""
    N, (_, D) = sorted_slot_N.numel(), src_TD.shape
    out_ND = torch.empty((N, D), device=src_TD.device, dtype=src_TD.dtype)
    if N == 0 or D == 0:
        return out_ND
    block_d = min(triton.next_power_of_2(D), 64 if interpreting() else max(16, 1024 // src_TD.element_size()))
    block_r = 4 if interpreting() else 16
    _gather_sorted_rows_kernel[(triton.cdiv(N, block_r), triton.cdiv(D, block_d))](
        src_TD, sorted_slot_N, offsets_E1[-1:], out_ND, top_k, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out_ND
