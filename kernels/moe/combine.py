"""The combine step shared by the bf16 and FP8 mega-MoE ops: the sum over k of each token's expert
rows, and the mask of slots that have an expert."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.triton_utils import cast_out, interpreting


@triton.jit
def _sum_over_k_kernel(
    buf_ptr,  # (N, D) rows by slot t*K+k, or by expert-sorted row if GATHER
    row_ptr,  # (N,) int32 row of each slot (read only if GATHER)
    out_ptr,  # (T, D)
    valid_ptr,  # (T*K,) int8: 0 for an empty slot (expert id -1), whose row was never written
    K_TOP,
    D,
    K_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_EMPTY: tl.constexpr,
    GATHER: tl.constexpr,
    STORE_EMPTY: tl.constexpr,  # False: a token with no valid slot keeps whatever its out row held
    SOFT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, K_POW2)
    slot = t * K_TOP + k
    kmask = k < K_TOP
    row = slot
    if GATHER:
        row = tl.load(row_ptr + slot, mask=kmask, other=0).to(tl.int64)
    if HAS_EMPTY:
        kmask = kmask & (tl.load(valid_ptr + slot, mask=k < K_TOP, other=0) != 0)
    mask = kmask[:, None] & (d < D)[None, :]
    vals = tl.load(buf_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    store = d < D
    if not STORE_EMPTY:
        store = store & (tl.max(kmask.to(tl.int32), axis=0) > 0)
    # A fixed-order sum in registers: deterministic, unlike float atomics into out.
    tl.store(out_ptr + t * D + d, cast_out(tl.sum(vals, axis=0), out_ptr.dtype.element_ty, SOFT), mask=store)


def sum_over_k(
    buf_ND: torch.Tensor,
    num_tokens: int,
    top_k: int,
    valid_N: torch.Tensor | None = None,
    row_of_slot_N: torch.Tensor | None = None,
    write_empty_rows: bool = True,
) -> torch.Tensor:
    """out[t] = sum_k buf[row(t*K + k)], accumulated in fp32, in buf's dtype.

    Args:
        buf_ND: (T*K, D) rows written per (token, k) slot by a GEMM epilogue, or, with
            ``row_of_slot_N``, rows in any order (e.g. expert-sorted) that the index maps slots to.
        valid_N: optional (T*K,) int8, 0 for empty slots (expert id -1): their rows are skipped.
        row_of_slot_N: optional (T*K,) int32 row of ``buf_ND`` holding each slot.
        write_empty_rows: False leaves the rows of tokens with no valid slot unwritten (undefined)
            instead of zero, for callers that never read them.
    Returns:
        (T, D) tensor.
    """
    D = buf_ND.shape[1]
    out_TD = torch.empty((num_tokens, D), device=buf_ND.device, dtype=buf_ND.dtype)
    if num_tokens == 0:
        return out_TD
    block_d = min(triton.next_power_of_2(D), 1024 if not interpreting() else 128)
    _sum_over_k_kernel[(num_tokens, triton.cdiv(D, block_d))](
        buf_ND, buf_ND if row_of_slot_N is None else row_of_slot_N,
        out_TD, buf_ND if valid_N is None else valid_N, top_k, D,
        K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d, HAS_EMPTY=valid_N is not None,
        GATHER=row_of_slot_N is not None, STORE_EMPTY=write_empty_rows or valid_N is None, SOFT=interpreting(),
        num_warps=4,
    )  # fmt: skip
    return out_TD


@triton.jit
def _zero_empty_rows_kernel(
    buf_ptr,  # (N, D) rows by slot
    sorted_slot_ptr,  # (N,) int32 slot of each expert-sorted row
    end_ptr,  # pointer to offsets_E1[E]: sorted rows from here on belong to empty slots
    N,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_R
    end = tl.load(end_ptr)
    # Empty slots sort last: blocks of sorted rows wholly before them have nothing to write.
    if first + BLOCK_R > end:
        r = first + tl.arange(0, BLOCK_R)
        empty = (r >= end) & (r < N)
        slot = tl.load(sorted_slot_ptr + r, mask=empty, other=0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        zeros = tl.zeros([BLOCK_R, BLOCK_D], dtype=buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + slot[:, None] * D + d[None, :], zeros, mask=empty[:, None] & (d < D)[None, :])


def one_slot_output(buf_ND: torch.Tensor, sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """``sum_over_k`` for top_k = 1, without its copy: each token's only slot row is its output, so
    ``buf_ND`` is returned with the rows of empty slots (never written by the GEMM) zeroed in place.
    Expert parallelism's receive side calls the op this way, with half its rows empty at the default
    capacity, so this writes a fraction of the bytes the copy reads and writes."""
    N, D = buf_ND.shape
    if N == 0:
        return buf_ND
    block_r, block_d = (16, min(triton.next_power_of_2(D), 512)) if not interpreting() else (4, 64)
    _zero_empty_rows_kernel[(triton.cdiv(N, block_r), triton.cdiv(D, block_d))](
        buf_ND, sorted_slot_N, offsets_E1[-1:], N, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4
    )
    return buf_ND


def combine_slots(ybuf_ND: torch.Tensor, num_tokens: int, top_k: int, sorted_slot_N: torch.Tensor,
                  offsets_E1: torch.Tensor, valid_N: torch.Tensor | None = None, write_empty_rows: bool = True
                  ) -> torch.Tensor:
    """The ops' combine: each token's sum over its k slot rows of ``ybuf_ND``, empty slots skipped
    (:func:`sum_over_k`); at top_k = 1 the slot rows themselves (:func:`one_slot_output`, in place).
    ``valid_N``: :func:`valid_slots`' mask where the caller has it already (made here otherwise).
    ``write_empty_rows`` False: the rows of tokens with no valid slot are left undefined, not zeroed
    (expert parallelism's receive side never reads them)."""
    if top_k == 1:
        return one_slot_output(ybuf_ND, sorted_slot_N, offsets_E1) if write_empty_rows else ybuf_ND
    if valid_N is None:
        valid_N = valid_slots(sorted_slot_N, offsets_E1)
    return sum_over_k(ybuf_ND, num_tokens, top_k, valid_N, write_empty_rows=write_empty_rows)


def valid_slots(sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """(N,) int8, 1 where the slot has an expert: empty slots (id -1) sort after the last expert's
    rows, i.e. at rows >= offsets_E1[E]."""
    N = sorted_slot_N.numel()
    in_expert_N = (torch.arange(N, device=sorted_slot_N.device) < offsets_E1[-1]).to(torch.int8)
    return torch.empty_like(in_expert_N).scatter(0, sorted_slot_N.long(), in_expert_N)
