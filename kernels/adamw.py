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

Compute copies: :meth:`TritonAdamW.attach_copy` gives a parameter a bf16 compute copy
(``components/precision/copies.py``) that the same pass writes from the updated value: 2 bytes more per such parameter instead of a separate refresh pass reading the float32
parameter again (4 + 2 bytes). The copy is the round-to-nearest cast ``p.to(bfloat16)`` makes.

Scope: float32 parameters and moments, float32 or bf16 gradients, contiguous; plain tensors or
DTensors (FSDP2 and expert-parallel shards: the update is elementwise, so each rank updates its
local shard; the moments are DTensors like the parameters, as torch's AdamW keeps them, so
distributed checkpoints hold the same state). Compute copies are for plain tensors (one process).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common.triton_utils import interpreting

BLOCK = 4096  # elements per program: 16 per thread at 8 warps, four 16-byte accesses per tensor
INTERPRETER_BLOCK = 1 << 16


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, copy_ptr, n, lr, wd, beta1, beta2, eps, step_size,
                  bc2_sqrt, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p * (1.0 - lr * wd)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        # bf16 round-to-nearest-even on the bits (the interpreter's cast truncates; the GPU's rounds
        # like this): add half an ulp of bf16, plus one if the kept lowest bit is odd; NaN stays NaN.
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(copy_ptr + offs, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                grad_scale: torch.Tensor | None = None, copy: torch.Tensor | None = None) -> None:
    """One AdamW update of ``param`` and its moments, in place; ``step`` counts from 1.

    ``grad_scale``: optional one-element float32 tensor on the parameter's device; the gradient is
    divided by it (torch's ``grad_scale`` convention; the trainer passes the clipping divisor).
    ``copy``: optional bf16 tensor of the parameter's shape, contiguous, overwritten with the
    updated parameter cast to bf16 (see the module docstring).
    """
    if step < 1:
        raise ValueError(f"adamw_step_: step counts from 1, got {step}")
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"adamw_step_: {name} must be float32, got {t.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"adamw_step_: the gradient must be float32 or bf16, got {grad.dtype}")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or not t.is_contiguous() or t.device != param.device:
            raise ValueError(f"adamw_step_: {name} must be contiguous, of the parameter's shape {tuple(param.shape)} "
                             f"and on its device; got {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}")
    if not param.is_cuda and not interpreting():
        raise RuntimeError("adamw_step_ runs on a CUDA GPU (or on CPU under TRITON_INTERPRET=1); use "
                           "[optimizer] implementation = \"foreach\" on CPU")
    if copy is not None and (copy.dtype != torch.bfloat16 or copy.shape != param.shape
                             or not copy.is_contiguous() or copy.device != param.device):
        raise ValueError(f"adamw_step_: the copy must be a contiguous bf16 tensor of the parameter's shape "
                         f"{tuple(param.shape)} on its device; got {copy.dtype} {tuple(copy.shape)} on "
                         f"{copy.device}, contiguous={copy.is_contiguous()}")
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32):
        raise ValueError(f"adamw_step_: grad_scale must be one float32 value, got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)}")
    n = param.numel()
    if n == 0:
        return
    bias_correction1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    # The interpreter pays per program, not per element: large blocks there keep the CPU tests quick.
    block = INTERPRETER_BLOCK if interpreting() else BLOCK
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, grad_scale if grad_scale is not None else param,
        copy.view(torch.int16) if copy is not None else param, n, lr, weight_decay, beta1, beta2, eps, lr / bias_correction1,
        bc2_sqrt, HAS_SCALE=grad_scale is not None, HAS_COPY=copy is not None, BLOCK=block, num_warps=8,
    )


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
        self._copies: dict[int, torch.Tensor] = {}  # id(parameter) -> its bf16 compute copy
        self._carriers: dict[int, torch.Tensor] = {}  # id(parameter) -> the tensor whose .grad is its gradient

    def _check_updates(self, who: str, param: torch.Tensor) -> None:
        if not any(param is q for g in self.param_groups for q in g["params"]):
            raise ValueError(f"{who}: the parameter {tuple(param.shape)} is not one this optimizer updates")

    def attach_copy(self, param: torch.Tensor, copy: torch.Tensor, grad_from_copy: bool = False) -> None:
        """Have every step also write ``param.to(bfloat16)`` into ``copy`` (contiguous bf16, the
        parameter's shape and device). A step that skips the parameter (no gradient) leaves both as
        they were, so the copy stays the parameter's cast. ``grad_from_copy``: the parameter's
        gradient is ``copy.grad`` (bf16; the model computed with the copy as a leaf), which
        :meth:`zero_grad` clears with the parameters' gradients."""
        self._check_updates("attach_copy", param)
        if type(param.data) is not torch.Tensor:
            raise TypeError(f"attach_copy: compute copies are for plain tensors (one process); got a "
                            f"{type(param.data).__name__} parameter")
        if copy.dtype != torch.bfloat16 or copy.shape != param.shape or not copy.is_contiguous() \
                or copy.device != param.device:
            raise ValueError(f"attach_copy: the copy must be a contiguous bf16 tensor of shape "
                             f"{tuple(param.shape)} on {param.device}; got {copy.dtype} {tuple(copy.shape)} "
                             f"on {copy.device}")
        self._copies[id(param)] = copy
        if grad_from_copy:
            self._carriers[id(param)] = copy

    def attach_grad_carrier(self, param: torch.Tensor, carrier: torch.Tensor) -> None:
        """The parameter's gradient is ``carrier.grad``: the model computed with ``carrier`` (a leaf
        of the parameter's shape, bf16, e.g. without storage when its values are never read, as the
        FP8 experts' carriers) in its place. :meth:`zero_grad` clears it with the parameters'."""
        self._check_updates("attach_grad_carrier", param)
        if carrier.shape != param.shape or carrier.device != param.device or not carrier.requires_grad:
            raise ValueError(f"attach_grad_carrier: the carrier must be a leaf that requires grad, of shape "
                             f"{tuple(param.shape)} on {param.device}; got {tuple(carrier.shape)} on {carrier.device}, "
                             f"requires_grad={carrier.requires_grad}")
        self._carriers[id(param)] = carrier

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if id(p) not in self._carriers:
            return p.grad
        carried = self._carriers[id(p)].grad
        if p.grad is None:
            return carried
        if carried is not None:
            raise RuntimeError(f"TritonAdamW: the parameter {tuple(p.shape)} takes its gradient from a carrier "
                               "but has a .grad of its own too (was it used outside the carrier?)")
        # A gradient set on the parameter itself (torch.distributed.checkpoint's state initialisation
        # sets zeros and steps with lr 0).
        return p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for carrier in self._carriers.values():
            if carrier.grad is not None:
                if set_to_none:
                    carrier.grad = None
                else:
                    carrier.grad.zero_()

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
            adamw_step_(_local(p), _local(grad).contiguous(), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                        lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], step=int(state["step"].item()), grad_scale=grad_scale,
                        copy=self._copies.get(id(p)))
        return loss
