"""Expert weights in their compute form, made once per optimizer step instead of on every call.

The expert weights are float32 master parameters. Without a cache every MoE call converts them:
the bf16 cast (autocast in one process, ``gather_weight`` under expert parallelism) and, for the
FP8 ``mega_fp8`` backend, the 128 x 128 block quantization into four e4m3 layouts. Under full
activation checkpointing a layer is called twice per micro-batch (forward and recomputation) and
the FP8 backward quantizes again, so per optimizer step the same conversion runs 2-3 times per
micro-batch; at the Qwen3-30B-A3B expert shape each bf16 cast moves ~3.6 GB (counted: 2.4 GB of
float32 read, 1.2 GB of bf16 written) and each FP8 quantization ~3.6 GB more.

:class:`ExpertWeightCache` holds the converted copies as non-persistent buffers (never in a
checkpoint) and :func:`refresh_expert_weight_caches` rewrites them in place. The trainer refreshes
every cache at the start of every optimizer step, outside the compiled graph: once per step,
whatever changed the weights (optimizer, checkpoint load). Staleness cannot be read off the
parameters: fused AdamW, and foreach AdamW on DTensors, update them without moving their
``_version`` counters (measured, torch 2.13 CPU). So an eager (uncompiled) forward outside the
trainer refreshes a cache that :func:`invalidate_expert_weight_caches` marked (the trainer hooks it
to ``optimizer.step``) or whose parameters' versions moved (plain in-place edits); a compiled
forward checks nothing. Gradients still reach the float32 parameters: the bf16 copies
enter through :class:`_CastFromCache` (backward: the cast's backward, ``grad.to(float32)``), and
the FP8 op takes the float32 weights as gradient carriers and writes their gradients in float32.

With ``[optimizer] implementation = "triton"`` the bf16 copies are written by the optimizer's own
pass (:meth:`kernels.adamw.TritonAdamW.attach_shadow`, wired by :func:`attach_caches_to_optimizer`):
its post-step hook marks those caches synced, and the step-start refresh skips a synced cache once
(any other change to the weights, such as a checkpoint load, must call
:func:`invalidate_expert_weight_caches`, which the trainer does after loading). Counted: 4 bytes per
expert parameter less per step (the refresh's float32 read), ~9.7 GB on both one-GPU proxies.

Gradient carriers (same optimizer, one process, no gradient accumulation): the bf16 copies can
also carry the experts' gradients. They become leaf tensors that require grad and the MoE reads them
directly, so the backward's bf16 weight gradients (``torch._grouped_mm`` writes bf16) land in their
``.grad`` as they are, not cast to a float32 ``.grad`` of the parameter; the Triton AdamW reads them
from there (:meth:`~kernels.adamw.TritonAdamW.attach_shadow` with ``grad_from_shadow``) and the
clipping norm includes them. Same gradient values (the float32 ones were casts of these), counted
per step: no cast pass (2 + 4 bytes per expert parameter), 2 bytes less read by the norm and by
AdamW each, no float32 gradient held (4 bytes): ~24 GB less traffic and 9.7 GB less memory on both
one-GPU proxies. With accumulation over micro-batches the sum would be bf16, so the trainer keeps
float32 gradients then.

Modes: ``"bf16"`` caches the compute-dtype copies (any backend); ``"fp8_blockwise"`` caches the
e4m3 copies of ``kernels/moe/mega_fp8/weights.py`` (backend ``mega_fp8``). Memory: one bf16 copy
of this rank's expert weights (1.2 GB per layer at the 30B shape), or the same in e4m3 (two
layouts of one byte each); ``[moe] cache_expert_weights = false`` turns the cache off.
"""

from __future__ import annotations

import torch
import torch.nn as nn

CACHE_MODES = ("bf16", "fp8_blockwise")
# fp8 mode: round float32 masters to bf16 inside the quantization pass (Triton's own conversion on the
# GPU) instead of casting them first. False restores the cast (session 8's landed form).
FUSED_BF16_ROUNDING = True


class _CastFromCache(torch.autograd.Function):
    """``w.to(dtype)`` whose value comes from the cache: forward returns the cached copy, backward is
    the cast's backward (the gradient in w's dtype)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        ctx.dtype = w.dtype
        return cached.view_as(cached)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) parameter, differentiably."""
    return w.to_local() if hasattr(w, "to_local") else w


class ExpertWeightCache(nn.Module):
    """The compute-form copies of one :class:`~models.moe.moe.GroupedExperts`' weights (this rank's
    shard under expert parallelism). Built by :func:`enable_expert_weight_cache` on the parameters'
    device, after initialisation and parallelisation."""

    def __init__(self, experts: nn.Module, mode: str, dtype: torch.dtype, pow2_scales: bool = False):
        super().__init__()
        if mode not in CACHE_MODES:
            raise ValueError(f"ExpertWeightCache mode must be one of {CACHE_MODES}, got {mode!r}")
        self.mode, self.dtype, self.pow2_scales = mode, dtype, pow2_scales
        if mode == "bf16":
            self._names: tuple[str, ...] = ("w1", "w3", "w2")
        else:
            from kernels.moe.mega_fp8.weights import TENSOR_FIELDS

            self._names = TENSOR_FIELDS
        # The buffers are the only copy; refresh() overwrites them in place (a compiled graph that
        # reads them stays valid).
        with torch.no_grad():
            for name, src in zip(self._names, self._sources(experts)):
                self.register_buffer(name, src.to(dtype, copy=True) if mode == "bf16" else src, persistent=False)
        self._versions: tuple[int, ...] | None = self.versions(experts)  # None: invalidated
        # True from an optimizer step that wrote the copies itself until the next refresh call.
        self._synced = False
        self.carries_grads = False  # see enable_grad_carriers

    def enable_grad_carriers(self) -> None:
        """Make the bf16 copies leaf tensors that receive the experts' gradients (module docstring).
        Only the optimizer that reads them (TritonAdamW with grad_from_shadow) may be used then: the
        parameters themselves get no gradient."""
        if self.mode != "bf16":
            raise ValueError(f"only the bf16 cache can carry gradients (this one is {self.mode!r})")
        for name in self._names:
            getattr(self, name).requires_grad_(True)
        self.carries_grads = True

    @property
    def grad_carriers(self) -> list[torch.Tensor]:
        """The copies whose ``.grad`` hold the experts' gradients (empty unless enabled)."""
        return [getattr(self, n) for n in self._names] if self.carries_grads else []

    def _sources(self, experts: nn.Module) -> list[torch.Tensor]:
        """What the buffers are made from: this rank's weights (bf16 mode, cast by the copy), or their
        e4m3 copies, quantized from the compute-dtype values as the uncached op does (the same bytes)."""
        w1, w3, w2 = (_local(w).detach() for w in (experts.w1, experts.w3, experts.w2))
        if self.mode == "bf16":
            return [w1, w3, w2]
        return self._quantize(w1, w3, w2).tensors()

    def _quantize(self, w1, w3, w2, out=None):
        """The e4m3 copies of (w1, w3, w2) as the op makes them from their compute-dtype values.
        float32 masters with a bf16 compute dtype are rounded inside the quantization pass (no cast
        pass over the weights: ~6 ms per step per layer at the 235B shape, Run 23)."""
        from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

        ws = (w1, w3, w2)
        fused = (FUSED_BF16_ROUNDING and self.dtype == torch.bfloat16
                 and all(w.dtype == torch.float32 and w.is_contiguous() for w in ws))
        if not fused:
            ws = tuple(w.to(self.dtype) for w in ws)
        return QuantizedExpertWeights.quantize(*ws, self.pow2_scales, out=out, round_bf16=fused)

    @property
    def quantized(self):
        """The e4m3 copies (fp8 mode) as the op takes them: views of the buffers, not a second copy."""
        from kernels.moe.mega_fp8.weights import QuantizedExpertWeights

        return QuantizedExpertWeights.from_tensors([getattr(self, n) for n in self._names], self.pow2_scales)

    @staticmethod
    def versions(experts: nn.Module) -> tuple[int, ...]:
        return tuple(w._version for w in (experts.w1, experts.w3, experts.w2))

    def is_stale(self, experts: nn.Module) -> bool:
        """Invalidated, or the parameters' versions moved (see the module docstring for what this
        cannot see)."""
        return self._versions != self.versions(experts)

    def invalidate(self) -> None:
        self._versions = None
        self._synced = False

    def mark_synced(self, experts: nn.Module) -> None:
        """The copies were just written from the parameters' current values (by the optimizer)."""
        self._versions = self.versions(experts)
        self._synced = True

    @property
    def shadows(self) -> dict[str, torch.Tensor]:
        """bf16 mode: parameter name (w1, w3, w2) -> its cached copy."""
        if self.mode != "bf16":
            raise ValueError(f"only the bf16 cache has per-parameter copies (this one is {self.mode!r})")
        return {n: getattr(self, n) for n in self._names}

    @torch.no_grad()
    def refresh(self, experts: nn.Module) -> None:
        self._synced = False
        if self.mode == "fp8_blockwise":
            # Quantized straight into the buffers: one pass per weight writes both its layouts (Run 22
            # profile, 235B one-layer proxy: the refresh through new tensors, a torch.cat of the
            # transposed halves and copies into the buffers cost ~28 ms of a 228 ms step).
            w1, w3, w2 = (_local(w).detach() for w in (experts.w1, experts.w3, experts.w2))
            self._quantize(w1, w3, w2, out=self.quantized)
        else:
            for name, src in zip(self._names, self._sources(experts)):
                getattr(self, name).copy_(src)
        self._versions = self.versions(experts)

    def weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) for the backend: the cached bf16 copies (differentiable w.r.t. the
        parameters), or in fp8 mode this rank's float32 weights themselves (gradient carriers for
        the op that reads :attr:`quantized`)."""
        if not torch.compiler.is_compiling() and self.is_stale(experts):
            self.refresh(experts)
        if self.carries_grads:
            return self.w1, self.w3, self.w2  # the gradients land on these leaves
        params = [_local(w) for w in (experts.w1, experts.w3, experts.w2)]
        if self.mode == "fp8_blockwise":
            return params[0], params[1], params[2]
        w1, w3, w2 = (_CastFromCache.apply(p, c) for p, c in zip(params, (self.w1, self.w3, self.w2)))
        return w1, w3, w2


def cache_mode(backend: str, compute_dtype: torch.dtype | None, experts_whole: bool) -> str | None:
    """The cache a backend can use, or None.

    Args:
        backend: the resolved MoE backend name.
        compute_dtype: the dtype the weights are cast to per call (None: no cast, float32 training).
        experts_whole: this rank's expert weights are whole (one process, or expert parallelism
            without expert-FSDP sharding); FP8 copies are only cached then (a shard's blocks would
            need an FP8 all-gather, not built).
    """
    if backend == "mega_fp8" and experts_whole and compute_dtype == torch.bfloat16:
        return "fp8_blockwise"
    if compute_dtype is not None:
        return "bf16"
    return None


def enable_expert_weight_cache(model: nn.Module, mode: str, dtype: torch.dtype, pow2_scales: bool = False) -> int:
    """Give every GroupedExperts of ``model`` a cache; returns how many."""
    from models.moe.moe import GroupedExperts

    n = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.weight_cache = ExpertWeightCache(module, mode, dtype, pow2_scales)
            n += 1
    return n


def _caches(model: nn.Module):
    from models.moe.moe import GroupedExperts

    for module in model.modules():
        if isinstance(module, GroupedExperts) and module.weight_cache is not None:
            yield module, module.weight_cache


def refresh_expert_weight_caches(model: nn.Module) -> int:
    """Remake every cache from the current parameters, except those the last optimizer step wrote
    itself (synced; they are remade next time unless the optimizer syncs them again); returns how
    many were remade."""
    n = 0
    for experts, cache in _caches(model):
        if cache._synced:
            cache._synced = False
            continue
        cache.refresh(experts)
        n += 1
    return n


def attach_caches_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, carry_grads: bool = False) -> int:
    """Let an optimizer that can (``attach_shadow``: :class:`kernels.adamw.TritonAdamW`) write the
    bf16 caches in its update pass, and mark them synced after each step; with ``carry_grads`` the
    caches also carry the experts' gradients (:meth:`ExpertWeightCache.enable_grad_carriers`) and
    the optimizer reads them there. Returns how many caches it took (0 when the optimizer cannot,
    or the caches are not bf16 copies of plain tensors)."""
    if not hasattr(optimizer, "attach_shadow"):
        return 0
    taken = []
    for experts, cache in _caches(model):
        params = {n: getattr(experts, n) for n in ("w1", "w3", "w2")}
        if cache.mode != "bf16" or cache.dtype != torch.bfloat16 or any(type(p.data) is not torch.Tensor
                                                                        for p in params.values()):
            continue
        if carry_grads:
            cache.enable_grad_carriers()
        for name, shadow in cache.shadows.items():
            optimizer.attach_shadow(params[name], shadow, grad_from_shadow=carry_grads)
        taken.append((experts, cache))
    if taken:
        def mark(*_):
            for experts, cache in taken:
                cache.mark_synced(experts)
        optimizer.register_step_post_hook(mark)
    return len(taken)


def expert_grad_carriers(model: nn.Module) -> list[torch.Tensor]:
    """Every cache's gradient carriers (tensors whose ``.grad`` the clipping norm must include)."""
    return [t for _, cache in _caches(model) for t in cache.grad_carriers]


def invalidate_expert_weight_caches(model: nn.Module) -> None:
    """Mark every cache stale (an eager forward then refreshes it)."""
    for _, cache in _caches(model):
        cache.invalidate()
