"""Block-scaled FP8 (e4m3) quantization, DeepSeek-V3 style, with a plain PyTorch reference per op.

Every quantized tensor is a pair ``(q, s)``: ``q`` in ``torch.float8_e4m3fn`` and ``s`` fp32 scales,
one per tile, such that ``x ~= q.float() * s`` tile by tile. The tiles:

- activations and gradients, :func:`quantize_1x128`: 1 x 128 along the last dim (the reduction
  dim of the GEMM that consumes them). (M, K) -> q (M, K), s (M, ceil(K/128)).
- expert-grouped 128 x 1 tiles for the MoE wgrad, :func:`quantize_cols_grouped`: the 128-row blocks
  follow each expert's rows (the tile table of :mod:`kernels.common.routing` with block_m = 128),
  so a block never straddles two experts; rows may be gathered by token on the fly. Stored
  "padded": tile i at columns [128 i, 128 i + 128), zero filled, so the wgrad GEMM reads whole
  aligned 128-column blocks with no row mask.
- weights, :func:`quantize_weight`: 128 x 128 blocks. (E, N, K) -> q (E, N, K),
  s (E, ceil(N/128), ceil(K/128)). A block's scale is symmetric in its two dims, so the transposed
  weight of dgrad is ``(q.mT, s.mT)``: no requantization.

Scale convention (all ops, kernel and reference alike): ``amax`` = max |x| over the tile (zero
padding for a partial last tile), clamped below by ``AMAX_EPS`` so an all-zero tile gets a finite
scale; ``s = amax / 448`` (448 = largest e4m3 value), correctly rounded; with ``pow2_scales`` s is
rounded *up* to a power of two (then ``x / s`` is exact and |x / s| <= 448 still holds);
``q = e4m3(clamp(x / s, -448, 448))`` rounded to nearest even. Inputs must be finite.

The Triton kernels are bit-identical to the references: the division is ``div_rn`` (IEEE,
correctly rounded, like torch's), and the fp32 -> e4m3 cast is RTNE either way. Under the Triton
interpreter that cast is done in integer arithmetic (:func:`_e4m3_bits_soft`) because the
interpreter's own fp32 -> fp8 conversion rounds wrongly (mantissa carries and subnormals); on the
GPU the hardware cast (``cvt.rn.satfinite``) is used.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.common.routing import max_tiles, tile_table
from kernels.common.triton_utils import interpreting

E4M3_MAX = 448.0
AMAX_EPS = 1e-12
TILE = 128  # the scale block along every quantized dim

_E4M3_MAX = tl.constexpr(448.0)
_AMAX_EPS = tl.constexpr(1e-12)
_TILE = tl.constexpr(128)

FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------------
# Triton helpers (also used by the GEMM epilogues of grouped_gemm.py)
# --------------------------------------------------------------------------------------------------


@triton.jit
def scale_from_amax(amax, POW2: tl.constexpr):
    """fp32 scale(s) from tile amax(es): max(amax, eps) / 448, optionally rounded up to 2^k."""
    s = tl.math.div_rn(tl.maximum(amax, _AMAX_EPS), _E4M3_MAX)
    if POW2:
        # Round up to a power of two on the bits: adding 2^23 - 1 carries into the exponent unless
        # the mantissa is already zero; then clear the mantissa. Exact, unlike exp2(ceil(log2)).
        u = s.to(tl.int32, bitcast=True)
        s = ((u + 0x7FFFFF) & -8388608).to(tl.float32, bitcast=True)  # -8388608 == 0xFF800000
    return s


@triton.jit
def _e4m3_bits_soft(y):
    """RTNE fp32 -> e4m3fn bit patterns (int32 in [0, 255]) for finite |y| <= 448, in integer math."""
    neg = y.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 maps to 0x80 as in torch
    a = tl.abs(y)
    ua = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even; a carry out of the
    # mantissa bumps the exponent, which is the right result.
    lsb = (ua >> 20) & 1
    ur = (ua + 0x7FFFF + lsb) & -1048576  # -1048576 == 0xFFF00000
    normal = (((ur >> 23) - 120) << 3) | ((ur >> 20) & 7)  # rebias 127 -> 7
    # Subnormal range: multiples of 2^-9; m == 8 is 2^-6, whose bit pattern is also 8.
    # (a * 2^9 + 2^23) - 2^23 rounds to an integer, ties to even, in fp32.
    m = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = tl.where(a >= 0.015625, normal, m)
    return tl.where(neg, bits | 0x80, bits)


@triton.jit
def to_e4m3_bits(y, SOFT: tl.constexpr):
    """e4m3 bytes (uint8) of fp32 ``y`` already clamped to [-448, 448]; stored through uint8 views."""
    if SOFT:
        return _e4m3_bits_soft(y).to(tl.uint8)
    else:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def quantize_tile(x, s):
    """x / s clamped to the e4m3 range, fp32 (the caller casts). ``s`` broadcasts against ``x``."""
    y = tl.math.div_rn(x, s)
    return tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)


# --------------------------------------------------------------------------------------------------
# Torch references
# --------------------------------------------------------------------------------------------------


def scale_from_amax_ref(amax: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """Reference of :func:`scale_from_amax` (fp32 in, fp32 out)."""
    amax = amax.float().clamp(min=AMAX_EPS)
    # A tensor divisor, not the Python scalar: on CUDA, torch divides by a scalar as a multiply by
    # its reciprocal (off by one ulp for most values), while the kernels divide correctly rounded.
    s = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scales:
        s = ((s.view(torch.int32) + 0x7FFFFF) & -8388608).view(torch.float32)
    return s


def _pad_last(x: torch.Tensor, mult: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % mult
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_1x128_ref(x: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_1x128`: (..., K) -> q (..., K) e4m3, s (..., ceil(K/128)) fp32."""
    K = x.shape[-1]
    xp = _pad_last(x.float(), TILE)
    xt = xp.reshape(*x.shape[:-1], -1, TILE)
    s = scale_from_amax_ref(xt.abs().amax(-1), pow2_scales)
    q = (xt / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.reshape(*x.shape[:-1], -1)[..., :K].contiguous(), s


def dequantize_rowwise_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of the 1 x 128 layout: q (..., K), s (..., ceil(K/128)) -> (..., K) in ``dtype``."""
    K = q.shape[-1]
    return (q.float() * s.repeat_interleave(TILE, dim=-1)[..., :K]).to(dtype)


def quantize_weight_ref(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_weight`: (E, N, K) -> q (E, N, K), s (E, ceil(N/128), ceil(K/128))."""
    E, N, K = w.shape
    wp = _pad_last(_pad_last(w.float(), TILE).transpose(1, 2), TILE).transpose(1, 2)
    nb, kb = wp.shape[1] // TILE, wp.shape[2] // TILE
    blocks = wp.reshape(E, nb, TILE, kb, TILE)
    s = scale_from_amax_ref(blocks.abs().amax(dim=(2, 4)), pow2_scales)
    q = (blocks / s[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.reshape(E, nb * TILE, kb * TILE)[:, :N, :K].contiguous(), s


def dequantize_weight_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of the 128 x 128 layout: q (E, N, K), s (E, ceil(N/128), ceil(K/128)) -> (E, N, K)."""
    E, N, K = q.shape
    full = s.repeat_interleave(TILE, dim=1).repeat_interleave(TILE, dim=2)[:, :N, :K]
    return (q.float() * full).to(dtype)


def quantize_cols_grouped_ref(
    x: torch.Tensor,
    offsets_E1: torch.Tensor,
    sorted_slot_N: torch.Tensor | None = None,
    top_k: int = 1,
    pow2_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_cols_grouped` (host loops; tests only): qt (K, n_tiles * 128),
    tile i's rows at columns ``128 i ...``, zeros past them; surplus tiles (which the kernel leaves
    undefined) zero here, with scale 0."""
    if sorted_slot_N is not None:
        xg = x[(sorted_slot_N.long() // top_k)]
    else:
        xg = x
    Nr, K = xg.shape
    E = offsets_E1.numel() - 1
    offs = offsets_E1.tolist()
    n_tiles = max_tiles(Nr, E, TILE)
    qt = torch.zeros((K, n_tiles * TILE), dtype=FP8, device=x.device)
    st = torch.zeros((K, n_tiles), dtype=torch.float32, device=x.device)
    tile = 0
    for e in range(E):
        for r0 in range(offs[e], offs[e + 1], TILE):
            r1 = min(r0 + TILE, offs[e + 1])
            q, s = quantize_1x128_ref(xg[r0:r1].t(), pow2_scales)  # (K, r1-r0), (K, 1)
            c0 = tile * TILE
            qt[:, c0 : c0 + r1 - r0] = q
            st[:, tile] = s[:, 0]
            tile += 1
    return qt, st


def group_tile_offsets(offsets_E1: torch.Tensor, block: int = TILE) -> torch.Tensor:
    """(E+1,) int32: expert e's 128-row blocks are tiles ``[out[e], out[e+1])`` of the tile table
    (tiles are ordered by expert, ceil(count_e / block) each). Device ops only, no host sync."""
    counts = offsets_E1[1:] - offsets_E1[:-1]
    tiles = (counts + block - 1) // block
    return torch.nn.functional.pad(torch.cumsum(tiles, 0), (1, 0)).to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_1x128_kernel(
    x_ptr,  # (M, K) bf16/fp32; with GATHER (T, K), row m reads token row slot[m] // TOP_K
    q_ptr,  # (M, K) uint8 view of e4m3 out
    s_ptr,  # (M, cdiv(K, 128)) fp32 out
    valid_ptr,  # (M, SLOTS) int8/bool: rows with no nonzero entry are skipped (when HAS_VALID)
    slot_ptr,  # (M,) int32 sorted slots (when GATHER)
    count_ptr,  # (1,) int32: rows from this one on are skipped (when GATHER)
    M,
    K,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    POW2: tl.constexpr,
    SOFT: tl.constexpr,
    HAS_VALID: tl.constexpr,
    GATHER: tl.constexpr,
    TOP_K: tl.constexpr,
):
    # One program per BLOCK_M rows, sweeping their K tiles: per-program latency, not bytes, bounds
    # this kernel, so the grid stays small and a program of empty rows exits at once.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    src_m = offs_m.to(tl.int64)
    if HAS_VALID:
        # Under expert parallelism half the received rows are empty: neither read nor written.
        nz = tl.zeros([BLOCK_M], dtype=tl.int32)
        for j in tl.static_range(SLOTS):
            v = tl.load(valid_ptr + offs_m.to(tl.int64) * SLOTS + j, mask=row_ok, other=0)
            nz += (v != 0).to(tl.int32)
        row_ok = row_ok & (nz > 0)
    if GATHER:
        row_ok = row_ok & (offs_m < tl.load(count_ptr))
        src_m = (tl.load(slot_ptr + offs_m, mask=row_ok, other=0) // TOP_K).to(tl.int64)
    if tl.max(row_ok.to(tl.int32), axis=0) > 0:
        num_kb = tl.cdiv(K, _TILE)
        for kb in range(0, num_kb):
            offs_k = kb * _TILE + tl.arange(0, _TILE)
            mask = row_ok[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_ptr + src_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            s = scale_from_amax(tl.max(tl.abs(x), axis=1), POW2)
            off = offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
            tl.store(q_ptr + off, to_e4m3_bits(quantize_tile(x, s[:, None]), SOFT), mask=mask)
            tl.store(s_ptr + offs_m.to(tl.int64) * num_kb + kb, s, mask=row_ok)


@triton.jit
def _cols_grouped_kernel(
    x_ptr,  # (T, K) if GATHER else (Nr, K)
    qt_ptr,  # (K, LDQ) uint8 out
    st_ptr,  # (num_tiles, K) fp32 out: a tile's K scales contiguous
    sorted_slot_ptr,  # (Nr,) int32 (read if GATHER)
    offsets_ptr,  # (E+1,) int32
    table_ptr,  # (2, num_tiles) int32, block_m = 128
    num_tiles,
    LDQ,  # row stride of qt: num_tiles * 128
    K,
    K_TOP,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,  # columns per program, swept BLOCK_K at a time
    GATHER: tl.constexpr,
    POW2: tl.constexpr,
    SOFT: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: the sweep's loads software-pipelined (async copies) this deep
):
    pid_t = tl.program_id(0)
    expert = tl.load(table_ptr + pid_t)
    if expert < 0:
        # Surplus tile of the static schedule (half the tiles under expert parallelism, whose empty
        # receive rows are slots of no expert): the wgrad GEMMs loop over each expert's tiles only.
        return
    # One program per tile and K_CHUNK columns, swept BLOCK_K at a time: per-program latency, not
    # bytes, bounds this kernel, so the grid stays small, and the tile's gather indices load once.
    offs_r = tl.arange(0, _TILE)
    row0 = tl.load(table_ptr + num_tiles + pid_t)
    row_end = tl.load(offsets_ptr + expert + 1)
    rows = row0 + offs_r
    rmask = rows < row_end
    if GATHER:
        src = (tl.load(sorted_slot_ptr + rows, mask=rmask, other=0) // K_TOP).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    k_begin = tl.program_id(1) * K_CHUNK
    k_end = tl.minimum(k_begin + K_CHUNK, K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        k64 = offs_k.to(tl.int64)
        mask = rmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + src[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        s = scale_from_amax(tl.max(tl.abs(x), axis=0), POW2)
        q = to_e4m3_bits(quantize_tile(x, s[None, :]), SOFT)
        # The whole 128-column block of tile pid_t: rows past the expert's end were loaded as +0.0,
        # which quantizes to the byte 0x00, so the block's tail is the zero padding the GEMM relies on.
        tl.store(qt_ptr + k64[None, :] * LDQ + pid_t * _TILE + offs_r[:, None], q, mask=kmask[None, :])
        tl.store(st_ptr + pid_t * K + k64, s, mask=kmask)


@triton.jit
def bf16_rounded(w, ROUND_BF16: tl.constexpr, SOFT: tl.constexpr):
    """w as fp32; with ROUND_BF16 its values rounded to bf16 (float32 masters quantized from the
    op's bf16 inputs without a cast pass over the weights)."""
    if ROUND_BF16:
        if SOFT:  # the interpreter's fp32 -> bf16 cast does not round to nearest even: on the bits
            u = w.to(tl.int32, bitcast=True)
            w = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            w = w.to(tl.bfloat16)
    return w.to(tl.float32)


@triton.jit
def _weight_kernel(
    w_ptr,  # (E, N, K)
    q_ptr,  # (E, N, K) uint8 out
    s_ptr,  # (E, cdiv(N, 128), cdiv(K, 128)) fp32 out
    qt_ptr,  # (E, K, LDT) uint8 out: q transposed at columns [QT_COL0, QT_COL0 + QT_COLS) (if TRANS)
    st_ptr,  # (E, cdiv(K, 128), LDST) fp32 out: s transposed at columns ST_COL0... (if TRANS)
    N,
    K,
    LDT,
    QT_COL0,
    QT_COLS,
    LDST,
    ST_COL0,
    POW2: tl.constexpr,
    SOFT: tl.constexpr,
    TRANS: tl.constexpr = False,
    ROUND_BF16: tl.constexpr = False,
):
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    offs_n = nb * _TILE + tl.arange(0, _TILE)
    offs_k = kb * _TILE + tl.arange(0, _TILE)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    off = e * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    w = bf16_rounded(tl.load(w_ptr + off, mask=mask, other=0.0), ROUND_BF16, SOFT)
    s = scale_from_amax(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
    q = to_e4m3_bits(quantize_tile(w, s), SOFT)
    tl.store(q_ptr + off, q, mask=mask)
    tl.store(s_ptr + (e * tl.cdiv(N, _TILE) + nb) * tl.cdiv(K, _TILE) + kb, s)
    if TRANS:
        # The dgrad layout: the same bytes transposed. Columns n in [N, QT_COLS) (padding of a layout
        # rounded up to 128) get the masked load's zeros.
        tmask = (offs_k < K)[:, None] & (offs_n < QT_COLS)[None, :]
        toff = e * K * LDT + offs_k.to(tl.int64)[:, None] * LDT + QT_COL0 + offs_n[None, :]
        # The quotients of w re-read in transposed order (L2 hits: this program just loaded them) and
        # quantized again with the same scale: the same bytes as tl.trans(q), whose layout conversion
        # through shared memory ran slower.
        toff_w = e * N * K + offs_k[:, None] + offs_n.to(tl.int64)[None, :] * K
        wt = tl.load(w_ptr + toff_w, mask=(offs_k < K)[:, None] & (offs_n < N)[None, :], other=0.0)
        qt = to_e4m3_bits(quantize_tile(bf16_rounded(wt, ROUND_BF16, SOFT), s), SOFT)
        tl.store(qt_ptr + toff, qt, mask=tmask)
        tl.store(st_ptr + (e * tl.cdiv(K, _TILE) + kb) * LDST + ST_COL0 + nb, s)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_input(x: torch.Tensor, ndim: int, name: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name}: expected bf16/fp16/fp32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (row-major), got strides {x.stride()}")


def quantize_1x128(x_MK: torch.Tensor, pow2_scales: bool = False, valid_MS: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x 128 tiles along the last dim (activations, gradients: the GEMM's reduction dim).

    Args:
        x_MK: (M, K) bf16/fp16/fp32, contiguous. K need not be a multiple of 128: the last tile's
            amax is over its K % 128 valid columns.
        pow2_scales: round each scale up to a power of two.
        valid_MS: optional (M, S) bool/int8, contiguous: a row with no nonzero entry (a token whose
            S routed slots are all empty) is neither read nor written, its q and s rows left
            undefined. For callers that read rows only through their valid slots.
    Returns:
        q_MK: (M, K) float8_e4m3fn.
        s_MKb: (M, ceil(K/128)) fp32, ``x[m, k] ~= q[m, k] * s[m, k // 128]``.
    """
    _check_input(x_MK, 2, "x_MK")
    M, K = x_MK.shape
    if valid_MS is not None and (valid_MS.dim() != 2 or valid_MS.shape[0] != M or not valid_MS.is_contiguous()
                                 or valid_MS.dtype not in (torch.bool, torch.int8, torch.uint8)):
        raise ValueError(f"valid_MS: expected a contiguous ({M}, S) bool/int8 mask, got "
                         f"{tuple(valid_MS.shape)} {valid_MS.dtype}")
    q = torch.empty((M, K), device=x_MK.device, dtype=FP8)
    s = torch.empty((M, triton.cdiv(K, TILE)), device=x_MK.device, dtype=torch.float32)
    if M == 0 or K == 0:
        return q, s
    block_m = 16
    valid = x_MK if valid_MS is None else valid_MS.view(torch.int8)
    _quantize_1x128_kernel[(triton.cdiv(M, block_m),)](
        x_MK, q.view(torch.uint8), s, valid, s, s, M, K, SLOTS=1 if valid_MS is None else valid_MS.shape[1],
        BLOCK_M=block_m, POW2=pow2_scales, SOFT=interpreting(), HAS_VALID=valid_MS is not None, GATHER=False,
        TOP_K=1, num_warps=8,
    )  # fmt: skip
    return q, s


def quantize_1x128_sorted(x_TD: torch.Tensor, sorted_slot_N: torch.Tensor, offsets_E1: torch.Tensor, top_k: int,
                          pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_1x128` of x's rows in expert-sorted order, in one pass: row r of the result is
    token row ``sorted_slot_N[r] // top_k`` quantized, for r < offsets_E1[E]; the later rows (empty
    slots) are left undefined. The operand of a grouped GEMM that takes no row index, as
    ``gather_sorted_rows`` of ``quantize_1x128(x)`` gives it, without writing and re-reading x's
    quantized copy: with one slot per row (expert parallelism's receive buffer) it moves 3 bytes
    an element instead of 5. Returns (q (N, D) e4m3, s (N, ceil(D/128)) fp32)."""
    _check_input(x_TD, 2, "x_TD")
    T, D = x_TD.shape
    N = sorted_slot_N.numel()
    if sorted_slot_N.dtype != torch.int32 or offsets_E1.dtype != torch.int32 or N != T * top_k:
        raise ValueError(f"sorted_slot_N ({sorted_slot_N.dtype}, {N} entries) and offsets_E1 ({offsets_E1.dtype}) "
                         f"must be int32, one slot per token x top_k = {T} x {top_k} (routing.sort_by_expert)")
    q = torch.empty((N, D), device=x_TD.device, dtype=FP8)
    s = torch.empty((N, triton.cdiv(D, TILE)), device=x_TD.device, dtype=torch.float32)
    if N == 0 or D == 0:
        return q, s
    block_m = 16
    _quantize_1x128_kernel[(triton.cdiv(N, block_m),)](
        x_TD, q.view(torch.uint8), s, s, sorted_slot_N, offsets_E1[-1:], N, D, SLOTS=1, BLOCK_M=block_m,
        POW2=pow2_scales, SOFT=interpreting(), HAS_VALID=False, GATHER=True, TOP_K=top_k, num_warps=8,
    )  # fmt: skip
    return q, s


def quantize_cols_grouped(
    x: torch.Tensor,
    offsets_E1: torch.Tensor,
    sorted_slot_N: torch.Tensor | None = None,
    top_k: int = 1,
    pow2_scales: bool = False,
    tiles: torch.Tensor | None = None,
    block_k: int | None = None,
    k_chunk: int | None = None,
    num_warps: int = 4,
    stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 1 tiles over each expert's rows: the token-dim-quantized operand of the MoE wgrad.

    Args:
        x: (Nr, K) rows in expert-sorted order (e.g. dH), or with ``sorted_slot_N`` (Nr,) the
            (T, K) token rows gathered as ``x[sorted_slot_N[r] // top_k]`` (e.g. the layer input).
        offsets_E1: (E+1,) int32 from :func:`kernels.common.routing.sort_by_expert`.
        tiles: optional tile table for block_m = 128 (built if None).
        block_k, k_chunk, num_warps, stages: columns per step (default 32 on the GPU), columns per
            program (a multiple of block_k, swept block_k at a time), warps, and the depth to which
            the sweep's loads are software-pipelined (1: not), for the benchmark sweep.
    Returns:
        qt_KP: (K, n_tiles * 128) e4m3, the quantized (gathered) rows stored transposed (token dim
            contiguous), each tile in its own 128 columns: tile i at columns [128 i, 128 i + 128),
            its rows first, then zeros (read unmasked by the GEMM). An expert's rows so start at a
            multiple of 128, which lets fp8_wgrad's token-dim loads be vectorized, for E * 128
            more columns than the rows. The columns of surplus tiles (past the experts' tiles) are
            left undefined.
        st_KT: (K, n_tiles) fp32, n_tiles = Nr // 128 + E: column i is tile i of the 128-row tile
            table; tile i covers rows ``[row0_i, min(row0_i + 128, end of its expert))``; surplus
            tiles' scales are left undefined. Stored tile-major, (n_tiles, K) contiguous, and
            returned as its transposed view (strides (1, K)), so that a GEMM reads one tile's
            scales for consecutive rows of K in one contiguous copy.
    """
    _check_input(x, 2, "x")
    Nr = sorted_slot_N.numel() if sorted_slot_N is not None else x.shape[0]
    K = x.shape[1]
    E = offsets_E1.numel() - 1
    n_tiles = max_tiles(Nr, E, TILE)
    ldq = n_tiles * TILE
    qt = torch.empty((K, ldq), device=x.device, dtype=FP8)
    st = torch.empty((n_tiles, K), device=x.device, dtype=torch.float32).t()
    if K == 0 or n_tiles == 0:
        return qt, st
    if tiles is None:
        tiles = tile_table(offsets_E1, Nr, TILE)
    # The interpreter's default is two steps per program, so the tests' widths exercise the sweep and
    # its partial last step.
    block_k = block_k or (64 if interpreting() else 32)
    k_chunk = k_chunk or (2 * block_k if interpreting() else 512)
    if k_chunk % block_k:
        raise ValueError(f"quantize_cols_grouped: k_chunk {k_chunk} must be a multiple of block_k {block_k}")
    _cols_grouped_kernel[(n_tiles, triton.cdiv(K, k_chunk))](
        x, qt.view(torch.uint8), st, sorted_slot_N if sorted_slot_N is not None else offsets_E1,
        offsets_E1, tiles, n_tiles, ldq, K, top_k,
        BLOCK_K=block_k, K_CHUNK=k_chunk, GATHER=sorted_slot_N is not None, POW2=pow2_scales,
        SOFT=interpreting(), STAGES=stages, num_warps=4 if interpreting() else num_warps,
    )  # fmt: skip
    return qt, st


def quantize_weight(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 block quantization of expert weights (once per optimizer step, then cached).

    Args:
        w: (E, N, K) or (N, K) bf16/fp16/fp32, contiguous; N, K any size (partial blocks masked).
    Returns:
        q: e4m3, w's shape.
        s: fp32 (E, ceil(N/128), ceil(K/128)) (or without E for a 2-D w),
            ``w[e, n, k] ~= q[e, n, k] * s[e, n // 128, k // 128]``. The transposed weight is
            ``(q.mT, s.mT)``: same bytes, same scales (:func:`quantize_weight_into` writes it too).
    """
    if w.dim() == 2:
        q, s = quantize_weight(w.unsqueeze(0), pow2_scales)
        return q[0], s[0]
    _check_input(w, 3, "w")
    E, N, K = w.shape
    q = torch.empty((E, N, K), device=w.device, dtype=FP8)
    s = torch.empty((E, triton.cdiv(N, TILE), triton.cdiv(K, TILE)), device=w.device, dtype=torch.float32)
    quantize_weight_into(w, q, s, pow2_scales=pow2_scales)
    return q, s


def quantize_weight_into(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor | None = None,
                         st: torch.Tensor | None = None, qt_col0: int = 0, qt_cols: int | None = None,
                         st_col0: int = 0, pow2_scales: bool = False, round_bf16: bool = False,
                         num_warps: int = 16) -> None:
    """:func:`quantize_weight` of w (E, N, K) into given tensors, optionally also writing the
    transposed layout in the same pass (one read of w: the compute copies' refresh).

    Args:
        q, s: (E, N, K) e4m3 and (E, ceil(N/128), ceil(K/128)) fp32 outputs, contiguous.
        qt, st: None, or (E, K, LDT) e4m3 and (E, ceil(K/128), LDST) fp32, contiguous: q transposed
            is written to ``qt[:, :, qt_col0 : qt_col0 + qt_cols]`` (columns past N get zeros;
            N <= qt_cols <= N rounded up to 128, default N), s transposed to
            ``st[:, :, st_col0 : st_col0 + ceil(N/128)]``. Other columns are not written (so two
            weights can share one qt, as the dX GEMM's [w1; w3]^T).
        round_bf16: quantize w's values rounded to bf16 (``w.to(torch.bfloat16)``'s values, without
            that cast's pass over the weights): float32 masters giving the bytes of the op's bf16 inputs.
            Triton's own fp32 -> bf16 conversion on the GPU: an integer rounding of the bits, combined
            with the transposed store, wrote wrong bytes on the H200.
    """
    _check_input(w, 3, "w")
    E, N, K = w.shape
    outputs = weight_output_args("quantize_weight_into", w.shape, q, s, qt, st, qt_col0, qt_cols, st_col0)
    if q.numel() == 0:
        return
    _weight_kernel[(E, triton.cdiv(N, TILE), triton.cdiv(K, TILE))](
        w, *outputs.tensors, N, K, *outputs.layout,
        POW2=pow2_scales, SOFT=interpreting(), TRANS=outputs.trans, ROUND_BF16=round_bf16 and w.dtype != torch.bfloat16,
        num_warps=num_warps,  # 16: faster than 8 or 32
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WeightOutputArgs:
    """The output arguments of a 128 x 128 weight quantization kernel: ``tensors`` (q, s, qt, st) as
    launch arguments (e4m3 as uint8 views; q and s again where there is no transposed layout),
    ``layout`` (LDT, QT_COL0, QT_COLS, LDST, ST_COL0), and ``trans``: the transposed layout is written."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    layout: tuple[int, int, int, int, int]
    trans: bool


def weight_output_args(who: str, shape: tuple[int, int, int], q: torch.Tensor, s: torch.Tensor,
                       qt: torch.Tensor | None, st: torch.Tensor | None, qt_col0: int = 0,
                       qt_cols: int | None = None, st_col0: int = 0) -> WeightOutputArgs:
    """Check the outputs of the quantization of an (E, N, K) weight (:func:`quantize_weight_into`'s
    arguments, which document them) and return them as the kernels take them; errors name ``who``."""
    E, N, K = shape
    NB, KB = triton.cdiv(N, TILE), triton.cdiv(K, TILE)
    for t, want, dtype, name in ((q, (E, N, K), FP8, "q"), (s, (E, NB, KB), torch.float32, "s")):
        if tuple(t.shape) != want or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be a contiguous {dtype} {want}, got {t.dtype} {tuple(t.shape)}")
    trans = qt is not None
    if trans != (st is not None):
        raise ValueError(f"{who}: pass both qt and st, or neither")
    qt_cols = N if qt_cols is None else qt_cols
    if trans:
        if (qt.dim() != 3 or qt.dtype != FP8 or not qt.is_contiguous() or qt.shape[:2] != (E, K)
                or not N <= qt_cols <= NB * TILE or qt_col0 + qt_cols > qt.shape[2]):
            raise ValueError(f"{who}: qt must be a contiguous e4m3 ({E}, {K}, >= {qt_col0 + qt_cols}) "
                             f"with N = {N} <= qt_cols <= {NB * TILE}; got {qt.dtype} {tuple(qt.shape)}, qt_cols {qt_cols}")
        if (st.dim() != 3 or st.dtype != torch.float32 or not st.is_contiguous() or st.shape[:2] != (E, KB)
                or st_col0 + NB > st.shape[2]):
            raise ValueError(f"{who}: st must be a contiguous fp32 ({E}, {KB}, >= {st_col0 + NB}); "
                             f"got {st.dtype} {tuple(st.shape)}")
    q8 = q.view(torch.uint8)
    if not trans:
        return WeightOutputArgs((q8, s, q8, s), (0, qt_col0, qt_cols, 0, st_col0), False)
    return WeightOutputArgs((q8, s, qt.view(torch.uint8), st), (qt.shape[2], qt_col0, qt_cols, st.shape[2], st_col0), True)
