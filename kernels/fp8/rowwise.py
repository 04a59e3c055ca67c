"""Rowwise-scaled FP8 (e4m3) GEMMs for training: TorchTitan's (torchao's) ``rowwise`` recipe.

A linear ``y = x W^T`` runs its forward and both backward GEMMs in FP8, each operand quantized
along the GEMM's reduction dim with one fp32 scale per row:

    forward  y  = x  W^T : x  (M, K) rowwise over K,      W  (N, K) rowwise over K
    dgrad    dx = dy W   : dy (M, N) rowwise over N,      W^T (K, N) rowwise over N (W's other dim)
    wgrad    dW = dy^T x : dy^T (N, M) and x^T (K, M), both rowwise over M (the tokens)

Each is :func:`scaled_mm_rowwise` (``a @ b^T`` with a and b quantized over their shared last
dim), so a weight and a gradient are quantized once per GEMM that reads them, in the layout that
GEMM needs. Everything is e4m3 (max 448), gradients included, as torchao's rowwise recipe does:
with a scale per row, e4m3's extra mantissa bit buys more than e5m2's range. The high-precision x
and W are saved for backward (as a bf16 linear saves them) and requantized there.

Scales: ``s = max(amax, 1e-12) / 448`` per row (amax in float32), rounded *up* to a power of two
(torchao's ``round_scales_to_power_of_2``): ``x / s`` is then exact and stays within +-448, and
``q * s`` dequantizes exactly, so an FP8 GEMM equals the float32 GEMM of the dequantized operands
up to accumulation order. ``q = e4m3(clamp(x / s, -448, 448))``.

``torch._scaled_mm`` runs these on CUDA (sm_89+); on CPU an exact emulation does. Its CUDA constraints, checked in
torch 2.11 and 2.13: a row-major, b column-major, K and both of b's dims multiples of 16, rowwise
scales fp32 of shapes (M, 1) and (1, N), bf16 output. :func:`scaled_mm_rowwise` zero-pads K
(the token count in wgrad) to a multiple of 16; the features of a converted linear must be
multiples of 16 already (``components/precision/float8.py`` checks).

How it reaches the compiler: the linear is one ``torch.library`` custom op (``fp8_rowwise::linear``)
whose autograd formula calls a second one (``fp8_rowwise::linear_backward``), both opaque to
inductor, each quantizing its operands with :func:`quantize_rowwise_fast` (Triton; bit for bit
:func:`quantize_rowwise`). Why custom ops and not a
``torch.autograd.Function`` traced by dynamo: under AOTAutograd on CUDA (torch 2.11, H200) such a
Function's backward received an all-zero tangent, so dx and dW came out zero, while eager and the
CPU were right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.common.triton_utils import interpreting
from kernels.fp8.blockwise import quantize_tile, scale_from_amax_ref, to_e4m3_bits
from kernels.fp8.blockwise import scale_from_amax as _scale_from_amax_tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_EPS = 1e-12  # all-zero rows get a tiny finite scale (and quantize to zeros)
ALIGN = 16  # _scaled_mm's (and _scaled_grouped_mm's) dimension multiple on CUDA

# torchao's rowwise defaults: fast (lower-precision) accumulation only for the forward GEMM; the
# gradient GEMMs accumulate in full fp32, as their reductions (the tokens, in wgrad) are long.
FAST_ACCUM_FORWARD = True
FAST_ACCUM_BACKWARD = False


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales ``max(amax, eps) / 448`` rounded up to a power of two, on the bits: adding
    2^23 - 1 carries into the exponent unless the mantissa is zero, then the mantissa is cleared
    (exact, unlike ``exp2(ceil(log2))``). The division is correctly rounded on every device (a
    tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can
    land an ulp above an exact power of two and double the scale), as the kernels' ``div_rn``."""
    return scale_from_amax_ref(amax, pow2_scales=True)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float -> q (..., K) e4m3, contiguous, and s (..., 1) fp32 with ``x ~= q * s``."""
    x32 = x.float()
    s = scale_from_amax(x32.abs().amax(dim=-1, keepdim=True))
    q = (x32 / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), s


@triton.jit
def _quantize_rows_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, R, C, stride_r, stride_c, SOFT: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """q[r, c] = e4m3(clamp(x[r, c] / s[r])) with s[r] = scale_from_amax(amax[r]) (power of two),
    for a (R, C) view of any strides; q contiguous. The column-block-0 programs store s. The scale
    is computed here rather than by torch ops: those were ~5 tiny launches per quantization."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < R
    mask = rmask[:, None] & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    scale = _scale_from_amax_tl(tl.load(amax_ptr + rows, mask=rmask, other=0.0).to(tl.float32), True)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + rows, scale, mask=rmask)
    bits = to_e4m3_bits(quantize_tile(x, scale[:, None]), SOFT)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], bits, mask=mask)


@triton.jit
def _quantize_contiguous_rows_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_r, SOFT: tl.constexpr,
                                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """:func:`_quantize_rows_kernel` with the row amax taken in the same program, for rows whose
    elements are contiguous: a first sweep over the columns reduces the amax, a second quantizes
    (its re-read of BLOCK_R rows mostly hits L2)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    base = x_ptr + rows[:, None].to(tl.int64) * stride_r
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(base + cols[None, :], mask=rmask[:, None] & (cols[None, :] < C), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = _scale_from_amax_tl(amax, True)
    tl.store(s_ptr + rows, scale, mask=rmask)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        bits = to_e4m3_bits(quantize_tile(x, scale[:, None]), SOFT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], bits, mask=mask)


def quantize_rowwise_fast(x: torch.Tensor, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` of a 2-D view of any strides, bit for bit. Rows with contiguous
    elements (activations, gradients, weights in the forward): one Triton launch that takes each
    row's amax and quantizes it. Other views (the transposed operands of the backward GEMMs): the row
    amax (``torch.linalg.vector_norm``, exact in x's dtype), then one Triton pass that derives the
    scales and quantizes. Either way one byte written per element and ~2 reads, instead of the ~40
    bytes of eager torch ops. Used where inductor does not fuse the quantization (the custom ops).
    ``use_triton``: default on CUDA tensors only; elsewhere this is :func:`quantize_rowwise` (the
    same bytes; the interpreter would be slow in the CPU tests, which run the kernels through
    ``use_triton=True``)."""
    if use_triton is None:
        use_triton = x.is_cuda
    if x.dim() != 2 or not use_triton:
        return quantize_rowwise(x)
    R, C = x.shape
    s = torch.empty((R, 1), device=x.device, dtype=torch.float32)
    q = torch.empty((R, C), device=x.device, dtype=E4M3)
    if R and C and x.stride(1) == 1:
        # Long rows: one a program (its second sweep re-reads it from L2); short ones: 4 a program.
        block_r, block_c = (64, 64) if interpreting() else ((1, 1024) if C >= 2048 else (4, 256))
        _quantize_contiguous_rows_kernel[(triton.cdiv(R, block_r),)](
            x, q.view(torch.uint8), s, R, C, x.stride(0), SOFT=interpreting(), BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=4)
        return q, s
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1)  # exact in x's dtype
    if R and C:
        # The interpreter pays per program: one large block there keeps the CPU tests quick.
        block_r, block_c = (256, 1024) if interpreting() else (32, 128)
        _quantize_rows_kernel[(triton.cdiv(R, block_r), triton.cdiv(C, block_c))](
            x, amax, q.view(torch.uint8), s, R, C, x.stride(0), x.stride(1), SOFT=interpreting(),
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    elif R:
        s.copy_(scale_from_amax(amax.view(R, 1)))
    return q, s


def pad_last_dim(x: torch.Tensor, multiple: int = ALIGN) -> torch.Tensor:
    """Zero-pads the last dim up to a multiple (a no-op when it is one already)."""
    pad = (-x.shape[-1]) % multiple
    return F.pad(x, (0, pad)) if pad else x


def _scaled_mm(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
               use_fast_accum: bool) -> torch.Tensor:
    if not qa.is_cuda:
        # CPU: torch 2.13's _scaled_mm takes rowwise scales there but torch 2.11's only per-tensor
        # ones; with power-of-two scales the dequantized operands are exact, so a float32 GEMM of
        # them is the same product (up to accumulation order) on every torch.
        return ((qa.float() * sa) @ (qb.float() * sb).t()).to(torch.bfloat16)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=use_fast_accum)


def scaled_mm_rowwise(a_MK: torch.Tensor, b_NK: torch.Tensor, use_fast_accum: bool,
                      quantize=quantize_rowwise) -> torch.Tensor:
    """``a @ b^T`` in FP8, both operands quantized rowwise over K: (M, K) x (N, K) -> (M, N) bf16.

    Any strides and float dtypes in; K is zero-padded to a multiple of 16 (zeros change no amax
    and add nothing to the product). ``quantize``: :func:`quantize_rowwise` (torch ops) or
    :func:`quantize_rowwise_fast` (the same bytes, one Triton pass on CUDA).
    """
    qa, sa = quantize(pad_last_dim(a_MK))
    qb, sb = quantize(pad_last_dim(b_NK))
    return _scaled_mm(qa, qb, sa, sb, use_fast_accum)


@torch.library.custom_op("fp8_rowwise::linear_backward", mutates_args=())
def _linear_backward(dy_MN: torch.Tensor, x_MK: torch.Tensor, w_NK: torch.Tensor, need_dx: bool,
                     need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = dy W and dW = dy^T x in FP8 (each an empty tensor when not needed), in x's and W's dtypes."""
    q = quantize_rowwise_fast
    dx_MK = (scaled_mm_rowwise(dy_MN, w_NK.t(), FAST_ACCUM_BACKWARD, quantize=q).to(x_MK.dtype) if need_dx
             else x_MK.new_empty(0))
    dw_NK = (scaled_mm_rowwise(dy_MN.t(), x_MK.t(), FAST_ACCUM_BACKWARD, quantize=q).to(w_NK.dtype) if need_dw
             else w_NK.new_empty(0))
    return dx_MK, dw_NK


@_linear_backward.register_fake
def _(dy_MN, x_MK, w_NK, need_dx, need_dw):
    return (x_MK.new_empty(x_MK.shape) if need_dx else x_MK.new_empty(0),
            w_NK.new_empty(w_NK.shape) if need_dw else w_NK.new_empty(0))


@torch.library.custom_op("fp8_rowwise::linear", mutates_args=())
def _linear_forward(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """y = x W^T in FP8 (both quantized rowwise over K), bf16."""
    return scaled_mm_rowwise(x_MK, w_NK, FAST_ACCUM_FORWARD, quantize=quantize_rowwise_fast)


@_linear_forward.register_fake
def _(x_MK, w_NK):
    return x_MK.new_empty((x_MK.shape[0], w_NK.shape[0]), dtype=torch.bfloat16)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # the high-precision x and W, requantized by the backward


def _autograd_backward(ctx, dy_MN: torch.Tensor):
    x_MK, w_NK = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx_MK, dw_NK = _linear_backward(dy_MN.contiguous(), x_MK, w_NK, need_dx, need_dw)
    return dx_MK if need_dx else None, dw_NK if need_dw else None


_linear_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def fp8_linear(x: torch.Tensor, weight_NK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight^T`` (no bias) with FP8 forward and backward GEMMs: (..., K) x (N, K) -> (..., N).

    ``x`` and ``weight`` may be float32 or bf16 (they are quantized from float32 either way);
    gradients come back in their dtypes. The output is ``out_dtype`` (default ``x.dtype``), cast
    from the GEMM's bf16.
    """
    if x.shape[-1] != weight_NK.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {tuple(weight_NK.shape)} wants "
                         f"{weight_NK.shape[1]}")
    x_MK = x.reshape(-1, x.shape[-1])
    y_MN = _linear_forward(x_MK, weight_NK).to(out_dtype or x.dtype)
    return y_MN.view(*x.shape[:-1], weight_NK.shape[0])
