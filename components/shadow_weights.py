"""bf16 compute copies of the dense linears' float32 weights, written by the optimizer and carrying
the gradients (``[optimizer] shadow_weights``, with ``implementation = "triton"``).

Why: in one process under bf16 autocast every ``nn.Linear`` casts its float32 weight to bf16 on each
call (the output head at the 235B-A22B shape: 622 M parameters, 2.5 GB read and 1.2 GB written per
call), its bf16 weight gradient is cast back to a float32 ``.grad`` (another 3.7 GB), and the
clipping norm and AdamW then read 4-byte gradients. Megatron's answer is bf16 model weights with
float32 master weights in the optimizer; this is that, for one process:

- :class:`ShadowLinear` (an ``nn.Linear`` whose class is swapped in place, as the FP8 conversion
  does) computes with ``weight_bf16``, a bf16 leaf tensor that requires grad; the float32 ``weight``
  stays the parameter (checkpoints, optimizer state) and gets no gradient.
- :class:`kernels.adamw.TritonAdamW` reads the gradient from ``weight_bf16.grad`` and writes the
  updated weight's bf16 cast into ``weight_bf16`` in the same pass (``attach_shadow``): no cast
  pass forward or backward.

The values are the ones autocast computes with (round-to-nearest casts of the same weights) and the
gradients the ones it produces (bf16 GEMM outputs), so training matches autocast's up to the
clipping norm's float32 summation order. Without gradient accumulation only (a sum over micro-
batches would be taken in bf16): the trainer enables this when the step has one micro-batch.

Counted (not measured) at the 235B-A22B 1-layer proxy: ~8.7 GB less traffic per step (output head
and attention projections), ~2 ms at the H200's 4.1 TB/s; the experts get the same treatment from
their weight cache (models/moe/weight_cache.py, "Gradient carriers").

Staleness: the optimizer keeps the copies current; an eager forward re-casts a copy whose weight's
version counter moved (in-place edits); a checkpoint load calls :func:`invalidate_shadows`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShadowLinear(nn.Linear):
    """``nn.Linear`` (no bias) computing with the bf16 copy ``weight_bf16`` of its float32 weight."""

    weight_bf16: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight)  # a float32 call (evaluation outside autocast): as nn.Linear
        if not torch.compiler.is_compiling() and self._shadow_version != self.weight._version:
            refresh_shadow(self)  # the weight was edited in place outside the optimizer
        return F.linear(x, self.weight_bf16)


def compute_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight a linear computes with (its bf16 shadow when it has one), for code that reads the
    weight directly instead of calling the module (the chunked linear + cross-entropy)."""
    return linear.weight_bf16 if isinstance(linear, ShadowLinear) else linear.weight


@torch.no_grad()
def refresh_shadow(module: ShadowLinear) -> None:
    module.weight_bf16.copy_(module.weight)
    module._shadow_version = module.weight._version


def shadowable(module: nn.Module) -> bool:
    """A plain float32 ``nn.Linear`` without bias holding a plain tensor (not FSDP's DTensor)."""
    return (type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.float32
            and type(module.weight.data) is torch.Tensor)


def enable_shadows(model: nn.Module, skip: tuple[type, ...] = ()) -> list[ShadowLinear]:
    """Swap every :func:`shadowable` linear of ``model`` (outside modules of the ``skip`` types, whose
    linears keep their own precision) for a :class:`ShadowLinear`; returns them."""
    skipped = {id(m) for s in model.modules() if isinstance(s, skip) for m in s.modules()}
    out = []
    for module in model.modules():
        if id(module) in skipped or not shadowable(module):
            continue
        module.__class__ = ShadowLinear
        module.register_buffer("weight_bf16", module.weight.detach().to(torch.bfloat16).requires_grad_(True),
                               persistent=False)
        module._shadow_version = module.weight._version
        out.append(module)
    return out


def shadows(model: nn.Module) -> list[ShadowLinear]:
    return [m for m in model.modules() if isinstance(m, ShadowLinear)]


def invalidate_shadows(model: nn.Module) -> None:
    """Re-cast every shadow from its weight now (after a checkpoint load wrote the weights)."""
    for module in shadows(model):
        refresh_shadow(module)


def attach_shadows_to_optimizer(modules: list[ShadowLinear], optimizer: torch.optim.Optimizer) -> None:
    """The optimizer reads each weight's gradient from its shadow and writes the shadow in its pass;
    after each step the shadows' versions are recorded (the optimizer's writes move no counter)."""
    for m in modules:
        optimizer.attach_shadow(m.weight, m.weight_bf16, grad_from_shadow=True)

    def mark(*_):
        for m in modules:
            m._shadow_version = m.weight._version

    optimizer.register_step_post_hook(mark)


def grad_carriers(model: nn.Module) -> list[torch.Tensor]:
    """The shadows (their ``.grad`` hold the linears' gradients), for the clipping norm."""
    return [m.weight_bf16 for m in shadows(model)]
