"""Triton helpers shared by every kernel in ``kernels/``: the interpreter switch, the fp32-accumulating
``tl.dot`` wrapper, the output cast, the tile prologues of the grouped GEMMs and the launch flags.

The ``@triton.jit`` helpers are inlined into the kernels that call them, so sharing them changes no
generated code."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (tests on CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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


@triton.jit
def m_tile_rows(work, num_n, table_ptr, offsets_ptr, num_tiles, BLOCK_M: tl.constexpr):
    """Rows of work item ``work`` (M-tile slowest, N-tile fastest) of an M-tiled grouped GEMM with
    ``num_n`` N-tiles: (N-tile index, then :func:`tile_rows`' expert, rows, row mask, safe rows)."""
    pid_m = work // num_n
    pid_n = work % num_n
    expert, rows, rmask, safe_rows = tile_rows(table_ptr, offsets_ptr, num_tiles, pid_m, BLOCK_M)
    return pid_n, expert, rows, rmask, safe_rows


@triton.jit
def n_tile_cols(pid_n, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns of N-tile ``pid_n`` over N and the first K step: (offs_n, offs_n_ld, offs_k).
    ``offs_n_ld`` wraps columns past N back into range, so that the K loop loads them unmasked; the
    store drops them."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    return offs_n, offs_n_ld, offs_k


@triton.jit
def load_k(ptrs, offs_k, k0, K, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """One K step's operand tile, masked past K unless EVEN_K; K runs along axis ``K_AXIS`` (0 or 1)."""
    if EVEN_K:
        tile = tl.load(ptrs)
    elif K_AXIS == 0:
        tile = tl.load(ptrs, mask=(offs_k + k0 < K)[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=(offs_k + k0 < K)[None, :], other=0.0)
    return tile


def launch_flags(dtype: torch.dtype) -> dict:
    """Constexpr flags every GEMM kernel takes: UPCAST (interpreter) and IEEE (fp32 inputs)."""
    return dict(UPCAST=interpreting(), IEEE=dtype == torch.float32)
