"""Triton helpers shared by the forward and backward kernels of the mega-MoE op."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.mega_moe.configs import TileConfig, interpreting


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    UPCAST: the Triton interpreter's ``tl.dot`` returns garbage for bf16/fp16 operands, so under
    the interpreter both operands are upcast to fp32 first (exact, just slower).
    IEEE: fp32 operands on the GPU would otherwise run as tf32; fp32 inputs ask for full precision.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def cast_out(x, dtype: tl.constexpr, SOFT: tl.constexpr):
    """fp32 ``x`` -> ``dtype`` (a kernel's output). Under the interpreter the fp32 -> bf16 rounding is
    done on the bits (RTNE), since the interpreter's own cast rounds wrongly when the mantissa carries."""
    if SOFT and dtype == tl.bfloat16:
        u = x.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        return u.to(tl.float32, bitcast=True).to(dtype)  # exact now
    else:
        return x.to(dtype)


@triton.jit
def expert_tile(pid, M, N, offsets_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid`` of a K-grouped (weight-gradient) GEMM over E x cdiv(M, BLOCK_M) x
    cdiv(N, BLOCK_N) output tiles, expert slowest: (expert, offs_m, offs_n, first row, end row)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    expert = pid // (num_m * num_n)
    pid_mn = pid % (num_m * num_n)
    offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    return expert, offs_m, offs_n, start, end


@triton.jit
def tile_rows(table_ptr, offsets_ptr, num_tiles, pid_m, BLOCK_M: tl.constexpr):
    """Rows of M-tile ``pid_m`` from the tile table: (expert, rows, row mask, safe rows).

    ``expert`` is -1 for a surplus tile. ``safe_rows`` replaces rows past the expert's end by the
    tile's first row so that unmasked loads of contiguous rows stay in bounds.
    """
    expert = tl.load(table_ptr + pid_m)
    row0 = tl.load(table_ptr + num_tiles + pid_m)
    row_end = tl.load(offsets_ptr + expert + 1, mask=expert >= 0, other=0)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    safe_rows = tl.where(rmask, rows, row0)
    return expert, rows, rmask, safe_rows


@triton.jit
def num_work(table_ptr, num_tiles, num_n):
    """Work items (M-tile, N-tile) of the real tiles: the count the tile table stores after itself."""
    return tl.load(table_ptr + 2 * num_tiles) * num_n


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def m_tiled_launch(n_tiles: int, num_n: int, cfg: TileConfig, device: torch.device) -> tuple[tuple[int], dict]:
    """Grid and loop arguments of an M-tiled GEMM kernel (gate_up, down, dh, dx).

    Every program loops ``for work in range(pid, num_work, NUM_PROGS)`` over the real tiles only. With
    ``cfg.persistent`` = p > 0 the grid is p programs per SM and the loop is flattened
    (``tl.range(..., flatten=True)``) so that the next tile's loads are issued during this tile's
    epilogue; with 0 the grid is the static bound (one program per possible tile), surplus programs
    skip the loop. Under the interpreter a persistent grid is 3 programs, to exercise the loop.
    """
    total = max(n_tiles * num_n, 1)
    if cfg.persistent:
        progs = 3 if interpreting() else cfg.persistent * _num_sms(device.index or 0)
        progs = min(total, progs)
    else:
        progs = total
    return (progs,), dict(NUM_PROGS=progs, PERSISTENT=bool(cfg.persistent))


def launch_flags(dtype: torch.dtype) -> dict:
    """Constexpr flags every GEMM kernel takes: UPCAST (interpreter) and IEEE (fp32 inputs)."""
    return dict(UPCAST=interpreting(), IEEE=dtype == torch.float32)


def launch_options(cfg: TileConfig) -> dict:
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@triton.jit
def _sum_over_k_kernel(
    buf_ptr,  # (N, D) rows by slot t*K+k, or by expert-sorted row if GATHER
    buf2_ptr,  # (N, D) a second buffer of the same layout, added (read only if TWO)
    row_ptr,  # (N,) int32 row of each slot (read only if GATHER)
    out_ptr,  # (T, D)
    valid_ptr,  # (T*K,) int8: 0 for an empty slot (expert id -1), whose row was never written
    K_TOP,
    D,
    K_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_EMPTY: tl.constexpr,
    GATHER: tl.constexpr,
    TWO: tl.constexpr,
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
    offs = row[:, None] * D + d[None, :]
    vals = tl.load(buf_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if TWO:
        vals += tl.load(buf2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # A fixed-order sum in registers: deterministic, unlike float atomics into out.
    tl.store(out_ptr + t * D + d, cast_out(tl.sum(vals, axis=0), out_ptr.dtype.element_ty, SOFT), mask=d < D)


def sum_over_k(
    buf_ND: torch.Tensor,
    num_tokens: int,
    top_k: int,
    valid_N: torch.Tensor | None = None,
    row_of_slot_N: torch.Tensor | None = None,
    buf2_ND: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k buf[row(t*K + k)] (+ buf2[same row]), accumulated in fp32, in buf's dtype.

    Args:
        buf_ND: (T*K, D) rows written per (token, k) slot by a GEMM epilogue, or, with
            ``row_of_slot_N``, rows in any order (e.g. expert-sorted) that the index maps slots to.
        valid_N: optional (T*K,) int8, 0 for empty slots (expert id -1): their rows are skipped.
        row_of_slot_N: optional (T*K,) int32 row of ``buf_ND`` holding each slot.
        buf2_ND: optional second buffer of ``buf_ND``'s layout, summed with it.
    Returns:
        (T, D) tensor.
    """
    D = buf_ND.shape[1]
    out_TD = torch.empty((num_tokens, D), device=buf_ND.device, dtype=buf_ND.dtype)
    if num_tokens == 0:
        return out_TD
    block_d = min(triton.next_power_of_2(D), 1024 if not interpreting() else 64)
    _sum_over_k_kernel[(num_tokens, triton.cdiv(D, block_d))](
        buf_ND, buf_ND if buf2_ND is None else buf2_ND, buf_ND if row_of_slot_N is None else row_of_slot_N,
        out_TD, buf_ND if valid_N is None else valid_N, top_k, D,
        K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d, HAS_EMPTY=valid_N is not None,
        GATHER=row_of_slot_N is not None, TWO=buf2_ND is not None, SOFT=interpreting(), num_warps=4,
    )  # fmt: skip
    return out_TD


def valid_slots(sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """(N,) int8, 1 where the slot has an expert: empty slots (id -1) sort after the last expert's
    rows, i.e. at rows >= offsets_E1[E]."""
    N = sorted_slot_N.numel()
    in_expert_N = (torch.arange(N, device=sorted_slot_N.device) < offsets_E1[-1]).to(torch.int8)
    return torch.empty_like(in_expert_N).scatter(0, sorted_slot_N.long(), in_expert_N)
