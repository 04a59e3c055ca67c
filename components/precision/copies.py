"""Compute copies: the bf16 (or, for the FP8 experts, e4m3) tensors the model computes with, made from
the float32 weights once per optimizer step or written by the optimizer itself, instead of a cast on
every call. One mechanism under one name; ``[precision] compute_copies`` switches it.

Why: the parameters are float32 masters. Without copies every call converts them: bf16 autocast
casts each ``nn.Linear`` weight, the experts' dispatch casts their weights (and gathers them under
expert parallelism), and the FP8 ``mega_fp8`` backend quantizes them into four e4m3 layouts. Under
full activation checkpointing a layer runs twice per micro-batch and the FP8 backward quantizes
again, so the same conversion runs 2-3 times per micro-batch; at the Qwen3-30B-A3B expert shape
each bf16 cast moves ~3.6 GB (2.4 GB of float32 read, 1.2 GB of bf16 written, counted) and each FP8
quantization ~3.6 GB more. Each weight gradient is also cast back from bf16 to a float32 ``.grad``.

Per module, a :class:`ComputeCopies` child named ``copies`` holds the copies of its owner's weights
as non-persistent buffers (never in a checkpoint): the experts' (``GroupedExperts.copies``, given by
``use_compute_copies``), or a linear's (:class:`ComputeLinear`, an ``nn.Linear`` whose class is
swapped in place as the FP8 conversion does, and its ``compute_weight`` that the chunked loss
reads). Modes: ``"bf16"`` (any backend, and the linears) or ``"fp8_blockwise"`` (the e4m3 copies of
``kernels/moe/mega_fp8/weights.py``, which the ``mega_fp8`` backend reads through
``BackendArgs.quantized``; float32 masters are rounded to bf16 inside the quantization pass, no cast).

Who keeps them current:

- The trainer refreshes every copy that is not current at the start of every optimizer step,
  outside the compiled graph (:func:`refresh_copies`). Staleness cannot be read off the parameters
  alone: fused AdamW, and foreach AdamW on DTensors, update them without moving their ``_version``
  counters. So an optimizer hook marks every copy stale (:func:`invalidate_copies`, also called
  after a checkpoint load), and a copy is current after it was built or refreshed, or written by the
  optimizer, until then or until its parameters' versions move (plain in-place edits). An eager
  forward refreshes a copy that is not current; a compiled one checks nothing.
- With ``[optimizer] implementation = "triton"``, :meth:`kernels.adamw.TritonAdamW.attach_copy`
  writes the bf16 copies from the updated values in its own pass (:func:`attach_to_optimizer`), 2
  bytes per parameter instead of a refresh reading the float32 parameter again (4 + 2 bytes); its
  post-step hook marks them current.
- Copies that carry the gradients (that optimizer, one process, one micro-batch per step): the bf16
  copies become leaf tensors that require grad and the model computes with them directly, so the
  bf16 weight gradients land in their ``.grad`` as they are; the optimizer reads them there
  (``grad_from_copy``) and the clipping norm includes them (:func:`grad_carriers`). Same gradient
  values (the float32 ones were casts of these), no cast pass, no float32 gradient held: counted
  ~24 GB less traffic and 9.7 GB less memory per step for the experts of either one-GPU proxy,
  ~8.7 GB less traffic for the linears of the 235B one-layer proxy. With accumulation the sum would
  be taken in bf16, so float32 gradients are kept then. The linears are only given copies in this
  setting. The FP8 experts' carriers are bf16 leaves without storage (their values are never read:
  the op reads the e4m3 copies), so their weight gradients are written and read in bf16 as the bf16
  experts' are, instead of float32: counted 4 bytes per expert weight less traffic per step (~2.4 GB
  per layer at the 30B shape) and 2 bytes less memory.

Without carriers the bf16 copies enter through :class:`_CastFromCopy` (backward: the cast's
backward, ``grad.to(float32)``), and the FP8 op takes the float32 weights as gradient carriers and
writes their gradients in float32. Memory: one bf16-sized copy of the weights concerned.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ("bf16", "fp8_blockwise")
EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _CastFromCopy(torch.autograd.Function):
    """``w.to(dtype)`` whose value comes from the copy: forward returns the copy, backward is the
    cast's backward (the gradient in w's dtype)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        ctx.dtype = w.dtype
        return cached.view_as(cached)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) parameter, differentiably. (An isinstance test:
    under dynamo ``hasattr(w, "to_local")`` was False for a DTensor parameter, so compiled blocks
    took the global tensor.)"""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class ComputeCopies(nn.Module):
    """The compute copies of one module's weights: a linear's ``weight``, or the experts' (w1, w3,
    w2) (this rank's shard under expert parallelism). Built on the parameters' device, after
    initialisation and parallelisation; the owner is passed to each call (a child cannot hold its
    parent)."""

    def __init__(self, owner: nn.Module, mode: str, dtype: torch.dtype, pow2_scales: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"ComputeCopies mode must be one of {MODES}, got {mode!r}")
        self.params = ("weight",) if isinstance(owner, nn.Linear) else EXPERT_WEIGHTS
        if mode == "fp8_blockwise" and (self.params != EXPERT_WEIGHTS or dtype != torch.bfloat16):
            raise ValueError("fp8_blockwise copies are the bf16 experts' e4m3 weights")
        self.mode, self.dtype, self.pow2_scales = mode, dtype, pow2_scales
        if mode == "bf16":
            self._names: tuple[str, ...] = self.params
        else:
            from kernels.moe.mega_fp8.weights import TENSOR_FIELDS

            self._names = TENSOR_FIELDS
        # The buffers are the only copy; refresh() overwrites them in place (a compiled graph that
        # reads them stays valid).
        with torch.no_grad():
            if mode == "bf16":
                made = [w.to(dtype, copy=True) for w in self._sources(owner)]
            else:
                made = self._quantize(*self._sources(owner)).tensors()
            for name, t in zip(self._names, made):
                self.register_buffer(name, t, persistent=False)
        self._versions: tuple[int, ...] | None = self.versions(owner)  # None: marked stale
        self.carries_grads = False  # see enable_grad_carriers

    def _sources(self, owner: nn.Module) -> list[torch.Tensor]:
        return [_local(getattr(owner, n)).detach() for n in self.params]

    def _quantize(self, w1_EFD, w3_EFD, w2_EDF, out=None):
        """The e4m3 copies as the op makes them from the bf16 values: float32 masters are rounded to
        bf16 inside the quantization pass (the same bytes as casting first, without the cast's pass)."""
        from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

        return QuantizedExpertWeights.quantize(w1_EFD, w3_EFD, w2_EDF, self.pow2_scales, out=out, round_bf16=True)

    @property
    def quantized(self):
        """The e4m3 copies (fp8 mode) as the op takes them: views of the buffers, not a second copy."""
        from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

        return QuantizedExpertWeights.from_tensors([getattr(self, n) for n in self._names], self.pow2_scales)

    def enable_grad_carriers(self) -> None:
        """Have the owner's gradients land on leaf tensors that are not the parameters (module
        docstring): the bf16 copies themselves, or in fp8 mode bf16 carriers without storage (a
        stride-0 view of one element: the op reads the e4m3 copies and only the carriers' shapes and
        dtypes), so the FP8 weight gradients are written and read in bf16, not float32. Only the
        optimizer that reads them (TritonAdamW: ``attach_copy(grad_from_copy=True)`` or
        ``attach_grad_carrier``) may be used then: the parameters themselves get no gradient."""
        if self.mode == "fp8_blockwise":
            for name in self.params:
                q = getattr(self, f"{name}_q")  # the e4m3 copy has the weight's shape
                one = torch.zeros((), dtype=torch.bfloat16, device=q.device)
                self.register_buffer(f"{name}_grad_carrier", one.expand(q.shape).requires_grad_(True), persistent=False)
        else:
            for name in self._names:
                getattr(self, name).requires_grad_(True)
        self.carries_grads = True

    @property
    def grad_carriers(self) -> list[torch.Tensor]:
        """The leaves whose ``.grad`` hold the owner's gradients, in ``params`` order (empty unless
        enabled)."""
        if not self.carries_grads:
            return []
        if self.mode == "fp8_blockwise":
            return [getattr(self, f"{n}_grad_carrier") for n in self.params]
        return [getattr(self, n) for n in self._names]

    @property
    def by_param(self) -> dict[str, torch.Tensor]:
        """bf16 mode: parameter name -> its copy."""
        if self.mode != "bf16":
            raise ValueError(f"only bf16 copies are per parameter (these are {self.mode!r})")
        return {n: getattr(self, n) for n in self._names}

    def versions(self, owner: nn.Module) -> tuple[int, ...]:
        return tuple(getattr(owner, n)._version for n in self.params)

    def is_stale(self, owner: nn.Module) -> bool:
        """Marked stale, or the parameters' versions moved (see the module docstring for what this
        cannot see)."""
        return self._versions != self.versions(owner)

    def invalidate(self) -> None:
        self._versions = None

    def mark_current(self, owner: nn.Module) -> None:
        """The copies were just written from the parameters' current values (by the optimizer)."""
        self._versions = self.versions(owner)

    @torch.no_grad()
    def refresh(self, owner: nn.Module) -> None:
        if self.mode == "fp8_blockwise":
            # Quantized straight into the buffers: one pass per weight writes both its layouts.
            self._quantize(*self._sources(owner), out=self.quantized)
        else:
            for name, src in zip(self._names, self._sources(owner)):
                getattr(self, name).copy_(src)
        self.mark_current(owner)

    def weights(self, owner: nn.Module) -> tuple[torch.Tensor, ...]:
        """The owner's weights for the computation: the bf16 copies (the carriers themselves, or
        differentiable w.r.t. the parameters), or in fp8 mode this rank's float32 weights (gradient
        carriers for the op that reads :attr:`quantized`)."""
        if not torch.compiler.is_compiling() and self.is_stale(owner):
            self.refresh(owner)
        if self.carries_grads:
            return tuple(self.grad_carriers)  # the gradients land on these leaves
        params = [_local(getattr(owner, n)) for n in self.params]
        if self.mode == "fp8_blockwise":
            return tuple(params)
        return tuple(_CastFromCopy.apply(p, getattr(self, n)) for p, n in zip(params, self._names))


class ComputeLinear(nn.Linear):
    """``nn.Linear`` (no bias) computing with the bf16 copy of its float32 weight under autocast."""

    copies: ComputeCopies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight)  # a float32 call (evaluation outside autocast): as nn.Linear
        return F.linear(x, self.compute_weight)

    @property
    def compute_weight(self) -> torch.Tensor:
        """The weight this linear computes with, for code that reads it instead of calling the module
        (the chunked output projection + cross-entropy)."""
        return self.copies.weights(self)[0]


def expert_copy_mode(backend: str, compute_dtype: torch.dtype | None, experts_whole: bool) -> str | None:
    """The experts' copies a backend can use, or None.

    Args:
        backend: the resolved MoE backend name.
        compute_dtype: the dtype the weights are cast to per call (None: no cast, float32 training).
        experts_whole: this rank's expert weights are whole (one process, or expert parallelism
            without expert-FSDP sharding); FP8 copies are only made then (a shard's blocks would
            need an FP8 all-gather, not built).
    """
    if backend == "mega_fp8" and experts_whole and compute_dtype == torch.bfloat16:
        return "fp8_blockwise"
    if compute_dtype is not None:
        return "bf16"
    return None


def linear_copyable(module: nn.Module) -> bool:
    """A plain float32 ``nn.Linear`` without bias holding a plain tensor (not FSDP's DTensor)."""
    return (type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.float32
            and type(module.weight.data) is torch.Tensor)


def make_compute_copies(model: nn.Module, experts: str | None, dtype: torch.dtype | None,
                        fp8_options=None, linears: bool = False, skip: tuple[type, ...] = ()
                        ) -> list[ComputeCopies]:
    """Give ``model`` its compute copies; returns them.

    ``experts``: the mode of every ``GroupedExperts``' copies (:func:`expert_copy_mode`), or None;
    the FP8 experts' backend arguments then carry their e4m3 copies (``BackendArgs.quantized``,
    quantized with ``fp8_options``' scale rounding). ``linears``: also every :func:`linear_copyable`
    linear outside modules of the ``skip`` types (whose linears keep their own precision), as a
    :class:`ComputeLinear` whose bf16 copy carries its gradient (only valid with an optimizer that
    takes it: :func:`attach_to_optimizer`)."""
    from models.moe.moe import GroupedExperts

    made = []
    if experts is not None:
        pow2 = fp8_options.pow2_scales if fp8_options is not None else False
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                copies = ComputeCopies(module, experts, dtype, pow2)
                args = module.args
                if experts == "fp8_blockwise":
                    args = dataclasses.replace(args, quantized=copies.quantized)
                module.use_compute_copies(copies, args)
                made.append(copies)
    if linears:
        skipped = {id(m) for s in model.modules() if isinstance(s, skip) for m in s.modules()}
        for module in list(model.modules()):
            if id(module) in skipped or not linear_copyable(module):
                continue
            module.__class__ = ComputeLinear
            module.copies = ComputeCopies(module, "bf16", torch.bfloat16)
            module.copies.enable_grad_carriers()
            made.append(module.copies)
    return made


def _owners(model: nn.Module):
    """(owner, copies) for every module of ``model`` with compute copies, the experts' first."""
    owned = [(m, m.copies) for m in model.modules() if isinstance(getattr(m, "copies", None), ComputeCopies)]
    return sorted(owned, key=lambda mc: isinstance(mc[0], nn.Linear))


def refresh_copies(model: nn.Module) -> int:
    """Remake every copy that is not current (module docstring); returns how many were remade."""
    n = 0
    for owner, copies in _owners(model):
        if copies.is_stale(owner):
            copies.refresh(owner)
            n += 1
    return n


def invalidate_copies(model: nn.Module) -> None:
    """Mark every copy stale (the next step start or eager use remakes it)."""
    for _, copies in _owners(model):
        copies.invalidate()


def grad_carriers(model: nn.Module) -> list[torch.Tensor]:
    """Every copy whose ``.grad`` holds a gradient (the clipping norm must include them), the
    experts' first."""
    return [t for _, copies in _owners(model) for t in copies.grad_carriers]


def attach_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, carry_grads: bool = False
                        ) -> list[ComputeCopies]:
    """Let an optimizer that can (``attach_copy``: :class:`kernels.adamw.TritonAdamW`) write the bf16
    copies of plain tensors in its update pass and mark them current after each step; with
    ``carry_grads`` the experts' copies also carry their gradients (the linears' always do) and the
    optimizer reads them there (the FP8 experts' too: their bf16 carriers, while their e4m3 copies
    stay refreshed at the step's start). Returns the copies it writes (none when the optimizer cannot)."""
    owned = _owners(model)
    if not hasattr(optimizer, "attach_copy"):
        if any(copies.carries_grads for _, copies in owned):
            raise ValueError("compute copies that carry gradients need an optimizer that reads them "
                             "(attach_copy: [optimizer] implementation = \"triton\")")
        return []
    taken = []
    for owner, copies in owned:
        params = {n: getattr(owner, n) for n in copies.params}
        if copies.dtype != torch.bfloat16 or any(type(p.data) is not torch.Tensor for p in params.values()):
            continue
        if carry_grads and not copies.carries_grads:
            copies.enable_grad_carriers()
        if copies.mode == "fp8_blockwise":
            # The optimizer cannot write e4m3 copies (they are refreshed at the step's start), but
            # it reads the gradients where the op wrote them.
            for name, carrier in zip(copies.params, copies.grad_carriers):
                optimizer.attach_grad_carrier(params[name], carrier)
            continue
        for name, copy in copies.by_param.items():
            optimizer.attach_copy(params[name], copy, grad_from_copy=copies.carries_grads)
        taken.append((owner, copies))
    if taken:
        def mark(*_):
            for owner, copies in taken:
                copies.mark_current(owner)
        optimizer.register_step_post_hook(mark)
    return [copies for _, copies in taken]
