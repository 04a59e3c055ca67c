"""AdamW's update as one Triton pass per parameter tensor, and the optimizer that runs it
(``[optimizer] implementation = "triton"``).

Why: the optimizer is a large part of the one-GPU proxy step (3.11 B float32 parameters,
BENCHMARKS.md). torch's fused AdamW moves 28 bytes per parameter (read parameter, gradient, both
moments; write parameter and moments) and, when it is given a ``grad_scale`` (how the trainer folds
gradient clipping into the step), also writes the unscaled gradient back: 32 bytes. This kernel
reads the scale and never writes the gradient: 28 bytes, each tensor streamed once with 16-byte
accesses. Counted, not measured: 87 GB per step at the 4-layer 30B proxy, ~21 ms at the 4.1 TB/s
device-to-device copy rate measured on the H200.

The math is torch's AdamW (decoupled weight decay, bias-corrected moments), in float32:

    p  <- p * (1 - lr * wd)
    m  <- beta1 * m + (1 - beta1) * g          g = grad / grad_scale (when a scale is given)
    v  <- beta2 * v + (1 - beta2) * g^2
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Results match torch's implementations to float32 rounding (they differ from each other in the
same way: fused, foreach and for-loop order these operations differently).

Shadows: :meth:`TritonAdamW.attach_shadow` gives a parameter a low-precision copy (a bf16
compute copy, ``components/compute_weights.py``) that the same pass writes from the updated
value: 2 bytes more per such parameter instead of a separate refresh pass reading the float32
parameter again (4 + 2 bytes). The copy is the round-to-nearest cast ``p.to(bfloat16)`` makes.

FP8 expert weights: :meth:`TritonAdamW.attach_fp8_weights` has the step of an (E, N, K) expert
weight write its block-scaled e4m3 copies (``kernels/fp8/blockwise.py``'s 128 x 128 weight blocks,
both layouts and the scales, as ``kernels/moe/mega_fp8/weights.py`` holds them) instead of the
elementwise pass: :func:`adamw_fp8_weight_step_`, one program per 128 x 128 block, which updates
the block, takes the amax of its bf16-rounded values, then reads the block it just wrote back
from L2 and quantizes it. Counted: 2 bytes of memory traffic more per parameter (the two e4m3
layouts) instead of the expert weight cache's separate refresh (4 bytes read, 2 written), and one
launch less per weight. Measured slower than the step + refresh (BENCHMARKS.md): the block-wise
pass, with its re-reads from L2, streams memory more slowly than the flat elementwise step. Parameters, moments and e4m3 bytes are bitwise those of
:func:`adamw_step_` followed by that refresh.

Scope: float32 parameters and moments, float32 or bf16 gradients, contiguous; plain tensors or
DTensors (FSDP2 and expert-parallel shards: the update is elementwise, so each rank updates its
local shard; the moments are DTensors like the parameters, as torch's AdamW keeps them, so
distributed checkpoints hold the same state). Shadows and FP8 copies are for plain tensors (one
process).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.fp8.blockwise import TILE, bf16_rounded, quantize_tile, scale_from_amax, to_e4m3_bits, weight_output_args
from kernels.triton_utils import interpreting

BLOCK = 4096  # elements per program: 16 per thread at 8 warps, four 16-byte accesses per tensor
INTERPRETER_BLOCK = 1 << 16
_TILE = tl.constexpr(TILE)  # the FP8 weight block's side (a kernel reads only constexpr globals)
# The FP8 weight step's launch: 8 rows of a block at a time, 8 warps: no spills when compiled for
# sm_90 (108 registers; 16 rows: 183; a whole block at once spills at any warp count). Untimed.
# The interpreter pays per slice, not per element: 64 rows there (still two slices per block).
FP8_ROWS, FP8_WARPS, INTERPRETER_FP8_ROWS = 8, 8, 64


@triton.jit
def _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, mask, lr, wd, beta1, beta2, eps, step_size, bc2_sqrt,
                  HAS_SCALE: tl.constexpr):
    """The update of the elements at ``offs`` (any shape): p, m and v stored, the new p returned
    (+0.0 where masked off). Every AdamW kernel runs exactly this code, so they update parameters
    and moments bitwise alike."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p * (1.0 - lr * wd)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    return p


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, shadow_ptr, n, lr, wd, beta1, beta2, eps, step_size,
                  bc2_sqrt, HAS_SCALE: tl.constexpr, HAS_SHADOW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, offs, mask, lr, wd, beta1, beta2, eps, step_size,
                      bc2_sqrt, HAS_SCALE)
    if HAS_SHADOW:
        # bf16 round-to-nearest-even on the bits (the interpreter's cast truncates; the GPU's rounds
        # like this): add half an ulp of bf16, plus one if the kept lowest bit is odd; NaN stays NaN.
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(shadow_ptr + offs, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _adamw_fp8_weight_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr,  # (E, N, K) float32 parameter and moments, float32/bf16 gradient
    scale_ptr,  # one float32 gradient divisor (if HAS_SCALE)
    q_ptr, s_ptr, qt_ptr, st_ptr,  # the e4m3 copies: kernels/fp8/blockwise.py's _weight_kernel outputs
    N, K, LDT, QT_COL0, QT_COLS, LDST, ST_COL0,
    lr, wd, beta1, beta2, eps, step_size, bc2_sqrt,
    HAS_SCALE: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr, TRANS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # One program per 128 x 128 block of one expert, in ROWS-row slices: the four float32 tiles of a
    # whole block would fill an SM's registers. First the update, slice by slice, keeping the amax
    # of the bf16-rounded values; then, the block's scale known, the updated block is read back
    # (L2 hits: this program just wrote it) and quantized as the expert weight cache's refresh does
    # (_weight_kernel): row slices for q, column slices read in transposed order for qt.
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    rows = tl.arange(0, ROWS)
    offs_n = nb * _TILE + tl.arange(0, _TILE)  # a whole block's, for the transposed slices
    offs_k = kb * _TILE + tl.arange(0, _TILE)
    base = e * N * K
    amax = tl.zeros((ROWS, _TILE), tl.float32)
    for r in range(0, _TILE, ROWS):
        n = nb * _TILE + r + rows
        mask = (n < N)[:, None] & (offs_k < K)[None, :]
        off = base + n.to(tl.int64)[:, None] * K + offs_k[None, :]
        p = _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, off, mask, lr, wd, beta1, beta2, eps, step_size,
                          bc2_sqrt, HAS_SCALE)
        amax = tl.maximum(amax, tl.abs(tl.where(mask, bf16_rounded(p, True, SOFT), 0.0)))
    s = scale_from_amax(tl.max(tl.max(amax, axis=1), axis=0), POW2)
    tl.store(s_ptr + (e * tl.cdiv(N, _TILE) + nb) * tl.cdiv(K, _TILE) + kb, s)
    # The stores above are read back by other threads of this program.
    tl.debug_barrier()
    for r in range(0, _TILE, ROWS):
        n = nb * _TILE + r + rows
        mask = (n < N)[:, None] & (offs_k < K)[None, :]
        off = base + n.to(tl.int64)[:, None] * K + offs_k[None, :]
        w = bf16_rounded(tl.load(p_ptr + off, mask=mask, other=0.0), True, SOFT)
        tl.store(q_ptr + off, to_e4m3_bits(quantize_tile(w, s), SOFT), mask=mask)
        if TRANS:
            # qt rows k = kb * 128 + r ...: the block's columns read in transposed order, quantized
            # with the same scale (the bytes of q transposed); columns n in [N, QT_COLS), a padded
            # layout's, get the masked load's zeros.
            k = kb * _TILE + r + rows
            wt = tl.load(p_ptr + base + k[:, None] + offs_n.to(tl.int64)[None, :] * K,
                         mask=(k < K)[:, None] & (offs_n < N)[None, :], other=0.0)
            qt = to_e4m3_bits(quantize_tile(bf16_rounded(wt, True, SOFT), s), SOFT)
            tl.store(qt_ptr + e * K * LDT + k.to(tl.int64)[:, None] * LDT + QT_COL0 + offs_n[None, :], qt,
                     mask=(k < K)[:, None] & (offs_n < QT_COLS)[None, :])
    if TRANS:
        tl.store(st_ptr + (e * tl.cdiv(K, _TILE) + kb) * LDST + ST_COL0 + nb, s)


def _check_step(who: str, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, grad_scale: torch.Tensor | None) -> None:
    if step < 1:
        raise ValueError(f"{who}: step counts from 1, got {step}")
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"{who}: {name} must be float32, got {t.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{who}: the gradient must be float32 or bf16, got {grad.dtype}")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or not t.is_contiguous() or t.device != param.device:
            raise ValueError(f"{who}: {name} must be contiguous, of the parameter's shape {tuple(param.shape)} "
                             f"and on its device; got {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}")
    if not param.is_cuda and not interpreting():
        raise RuntimeError(f"{who} runs on a CUDA GPU (or on CPU under TRITON_INTERPRET=1); use "
                           "[optimizer] implementation = \"foreach\" on CPU")
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32):
        raise ValueError(f"{who}: grad_scale must be one float32 value, got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)}")


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> tuple:
    """The kernels' scalar arguments: lr, wd, beta1, beta2, eps, step_size, bc2_sqrt."""
    bias_correction1 = 1.0 - beta1**step
    return lr, weight_decay, beta1, beta2, eps, lr / bias_correction1, math.sqrt(1.0 - beta2**step)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                grad_scale: torch.Tensor | None = None, shadow: torch.Tensor | None = None) -> None:
    """One AdamW update of ``param`` and its moments, in place; ``step`` counts from 1.

    ``grad_scale``: optional one-element float32 tensor on the parameter's device; the gradient is
    divided by it (torch's ``grad_scale`` convention; the trainer passes the clipping divisor).
    ``shadow``: optional bf16 tensor of the parameter's shape, contiguous, overwritten with the
    updated parameter cast to bf16 (see the module docstring).
    """
    _check_step("adamw_step_", param, grad, exp_avg, exp_avg_sq, step, grad_scale)
    if shadow is not None and (shadow.dtype != torch.bfloat16 or shadow.shape != param.shape
                               or not shadow.is_contiguous() or shadow.device != param.device):
        raise ValueError(f"adamw_step_: the shadow must be a contiguous bf16 tensor of the parameter's shape "
                         f"{tuple(param.shape)} on its device; got {shadow.dtype} {tuple(shadow.shape)} on "
                         f"{shadow.device}, contiguous={shadow.is_contiguous()}")
    n = param.numel()
    if n == 0:
        return
    # The interpreter pays per program, not per element: large blocks there keep the CPU tests quick.
    block = INTERPRETER_BLOCK if interpreting() else BLOCK
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, grad_scale if grad_scale is not None else param,
        shadow.view(torch.int16) if shadow is not None else param, n,
        *_scalars(lr, beta1, beta2, eps, weight_decay, step),
        HAS_SCALE=grad_scale is not None, HAS_SHADOW=shadow is not None, BLOCK=block, num_warps=8,
    )


def adamw_fp8_weight_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                           *, q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor | None = None,
                           st: torch.Tensor | None = None, qt_col0: int = 0, qt_cols: int | None = None,
                           st_col0: int = 0, pow2_scales: bool = False, lr: float, beta1: float, beta2: float,
                           eps: float, weight_decay: float, step: int, grad_scale: torch.Tensor | None = None,
                           rows: int | None = None, num_warps: int = FP8_WARPS) -> None:
    """:func:`adamw_step_` of an (E, N, K) weight that also writes its e4m3 copies from the updated
    values, in the same pass.

    The copies are ``kernels.fp8.blockwise.quantize_weight_into(param, q, s, qt, st, qt_col0,
    qt_cols, st_col0, pow2_scales, round_bf16=True)`` of the updated parameter, bitwise (that
    function documents the outputs; N, K need not be multiples of 128: partial blocks are masked as
    there). Parameter and moments are bitwise :func:`adamw_step_`'s. One program per 128 x 128 block,
    ``rows`` (a power of two <= 128; default FP8_ROWS) rows of it at a time, ``num_warps`` warps
    (launch parameters).
    """
    who = "adamw_fp8_weight_step_"
    _check_step(who, param, grad, exp_avg, exp_avg_sq, step, grad_scale)
    if param.dim() != 3:
        raise ValueError(f"{who}: the parameter must be an (E, N, K) expert weight, got shape {tuple(param.shape)}")
    rows = rows or (INTERPRETER_FP8_ROWS if interpreting() else FP8_ROWS)
    if rows not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"{who}: rows must be a power of two <= 128, got {rows}")
    outputs = weight_output_args(who, param.shape, q, s, qt, st, qt_col0, qt_cols, st_col0)
    if param.numel() == 0:
        return
    E, N, K = param.shape
    _adamw_fp8_weight_kernel[(E, triton.cdiv(N, TILE), triton.cdiv(K, TILE))](
        param, grad, exp_avg, exp_avg_sq, grad_scale if grad_scale is not None else param,
        *outputs.tensors, N, K, *outputs.layout, *_scalars(lr, beta1, beta2, eps, weight_decay, step),
        HAS_SCALE=grad_scale is not None, POW2=pow2_scales, SOFT=interpreting(), TRANS=outputs.trans, ROWS=rows,
        num_warps=num_warps,
    )  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: updated in place), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs :func:`adamw_step_` on each parameter.

    Same hyperparameters, param groups, state (``step``, ``exp_avg``, ``exp_avg_sq``) and state
    dict as ``torch.optim.AdamW``, so checkpoints move between the two. Honours ``grad_scale``
    (set by the trainer to fold gradient clipping into the step) as torch's fused AdamW does,
    without writing the unscaled gradients back. No amsgrad, maximize, capturable or
    differentiable modes (refused at construction).
    """

    folds_grad_scale = True  # the trainer may set .grad_scale instead of clipping in place

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)
        for group in self.param_groups:
            for p in group["params"]:
                local = _local(p.data)
                if p.dtype != torch.float32 or not local.is_contiguous():
                    raise TypeError(f"TritonAdamW needs contiguous float32 parameters (local shards), got {p.dtype} "
                                    f"{tuple(local.shape)} contiguous={local.is_contiguous()}")
        self._shadows: dict[int, torch.Tensor] = {}  # id(parameter) -> its bf16 shadow
        self._grad_from_shadow: set[int] = set()  # ids of parameters whose gradient is their shadow's .grad
        self._fp8: dict[int, dict] = {}  # id(expert weight) -> adamw_fp8_weight_step_'s output arguments

    def _check_attachable(self, who: str, param: torch.Tensor) -> None:
        if not any(param is q for g in self.param_groups for q in g["params"]):
            raise ValueError(f"{who}: the parameter {tuple(param.shape)} is not one this optimizer updates")
        if type(param.data) is not torch.Tensor:
            raise TypeError(f"{who}: the copies written in the step are for plain tensors (one process); got a "
                            f"{type(param.data).__name__} parameter")
        if id(param) in self._shadows or id(param) in self._fp8:
            raise ValueError(f"{who}: the parameter {tuple(param.shape)} already has a copy written in the step")

    def attach_shadow(self, param: torch.Tensor, shadow: torch.Tensor, grad_from_shadow: bool = False) -> None:
        """Have every step also write ``param.to(bfloat16)`` into ``shadow`` (contiguous bf16, the
        parameter's shape and device). A step that skips the parameter (no gradient) leaves both as
        they were, so the shadow stays the parameter's cast. ``grad_from_shadow``: the parameter's
        gradient is ``shadow.grad`` (bf16; the model computed with the shadow as a leaf), which
        :meth:`zero_grad` clears with the parameters' gradients."""
        self._check_attachable("attach_shadow", param)
        if shadow.dtype != torch.bfloat16 or shadow.shape != param.shape or not shadow.is_contiguous() \
                or shadow.device != param.device:
            raise ValueError(f"attach_shadow: the shadow must be a contiguous bf16 tensor of shape "
                             f"{tuple(param.shape)} on {param.device}; got {shadow.dtype} {tuple(shadow.shape)} "
                             f"on {shadow.device}")
        self._shadows[id(param)] = shadow
        if grad_from_shadow:
            self._grad_from_shadow.add(id(param))

    def attach_fp8_weights(self, param: torch.Tensor, outputs: dict, pow2_scales: bool = False,
                           rows: int | None = None, num_warps: int = FP8_WARPS) -> None:
        """Have every step of the (E, N, K) expert weight ``param`` also write its block-scaled e4m3
        copies, from the updated values (:func:`adamw_fp8_weight_step_`, launched with ``rows`` and
        ``num_warps``). ``outputs``: where, ``quantize_weight_into``'s output arguments (q, s and
        optionally qt, st, qt_col0, qt_cols, st_col0; ``QuantizedExpertWeights.outputs()`` gives them
        per weight), checked here. A step that skips the parameter (no gradient) leaves both as they
        were. Not together with :meth:`attach_shadow` on the same parameter."""
        self._check_attachable("attach_fp8_weights", param)
        if param.dim() != 3:
            raise ValueError(f"attach_fp8_weights: the parameter must be an (E, N, K) expert weight, got shape "
                             f"{tuple(param.shape)}")
        weight_output_args("attach_fp8_weights", param.shape, **outputs)
        if outputs["q"].device != param.device:
            raise ValueError(f"attach_fp8_weights: the copies are on {outputs['q'].device}, the parameter on {param.device}")
        self._fp8[id(param)] = dict(outputs, pow2_scales=pow2_scales, rows=rows, num_warps=num_warps)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if id(p) not in self._grad_from_shadow:
            return p.grad
        shadow_grad = self._shadows[id(p)].grad
        if p.grad is None:
            return shadow_grad
        if shadow_grad is not None:
            raise RuntimeError(f"TritonAdamW: the parameter {tuple(p.shape)} takes its gradient from its bf16 shadow "
                               "but has a .grad of its own too (was it used outside the shadow?)")
        # A gradient set on the parameter itself (torch.distributed.checkpoint's state initialisation
        # sets zeros and steps with lr 0).
        return p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for i in self._grad_from_shadow:
            shadow = self._shadows[i]
            if shadow.grad is not None:
                if set_to_none:
                    shadow.grad = None
                else:
                    shadow.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            grad_scale = grad_scale.float().reshape(1)
        if getattr(self, "found_inf", None) is not None:
            raise NotImplementedError("TritonAdamW does not skip steps on found_inf (no fp16 GradScaler support)")
        work = [(p, grad, group) for group in self.param_groups for p in group["params"]
                if (grad := self._grad(p)) is not None]
        # Largest tensors first: while the GPU runs their long passes the host launches the small
        # ones (norm weights), instead of the GPU idling between launches of tiny kernels.
        work.sort(key=lambda item: -item[0].numel())
        for p, grad, group in work:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:
                # torch's AdamW state layout: a float32 step count on the CPU (no device sync to read it).
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif state["step"].device.type != "cpu":
                state["step"] = state["step"].cpu()  # loaded from a fused AdamW: one copy, then on the CPU
            state["step"] += 1
            args = (_local(p), _local(grad).contiguous(), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
            kw = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], step=int(state["step"].item()), grad_scale=grad_scale)
            if id(p) in self._fp8:
                adamw_fp8_weight_step_(*args, **self._fp8[id(p)], **kw)
            else:
                adamw_step_(*args, **kw, shadow=self._shadows.get(id(p)))
        return loss
