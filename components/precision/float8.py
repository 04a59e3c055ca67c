"""FP8 dense linears (``[precision] linear = "fp8_rowwise"``): the attention projections of every
block run their three GEMMs in rowwise-scaled FP8 (``kernels/fp8/rowwise.py``).

Converted: ``attention.wq``, ``wk``, ``wv``, ``wo``. Left in bf16: the embedding, the norms, the
router gate (E outputs: small, and routing decisions are sensitive to it), the output head (its
logits feed the loss directly, as in TorchTitan's default filter) and the experts (their precision
is ``[precision] moe``).

The swap happens on the meta-device model, before parallelisms are applied. A converted module
keeps its ``weight`` Parameter object (a plain float32 tensor), so FSDP2 shards and gathers it as
before (in bf16 under its mixed-precision policy), checkpoints keep their keys, and the FP8 copies
exist only transiently inside each GEMM.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from kernels.fp8.rowwise import ALIGN, fp8_linear
from models.qwen3.model import Attention

# The projections that ``[precision] linear`` converts, by attribute name on each attention module.
ATTENTION_PROJECTIONS = ("wq", "wk", "wv", "wo")


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose forward and backward GEMMs run in rowwise FP8.

    The output dtype is what ``nn.Linear`` would give: the autocast dtype under autocast, else the
    input's dtype. Inputs may be float32 (under CPU/CUDA autocast the residual stream arrives in
    float32) or bf16 (FSDP's mixed precision); both are quantized from float32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        y = fp8_linear(x, self.weight, out_dtype)
        return y if self.bias is None else y + self.bias.to(out_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameters (no copy, no allocation)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        return new


def convert_to_float8(model: nn.Module, linear: str, log: Callable[[str], None] = print) -> int:
    """Swaps the attention projections of ``model`` for :class:`Float8Linear` when ``linear``
    (``[precision] linear``) is ``"fp8_rowwise"`` (else does nothing); returns how many were converted.

    A projection whose in or out features are not multiples of 16 (what ``torch._scaled_mm`` needs
    on CUDA) stays bf16, with a logged reason.
    """
    if linear == "none":
        return 0
    if linear != "fp8_rowwise":
        raise ValueError(f"[precision] linear = {linear!r} is not a known dense-linear precision")
    converted = 0
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        for proj in ATTENTION_PROJECTIONS:
            linear = getattr(module, proj)
            if type(linear) is not nn.Linear:
                continue
            if linear.in_features % ALIGN or linear.out_features % ALIGN:
                log(f"[precision] linear: {name}.{proj} stays bf16: its shape ({linear.out_features}, "
                    f"{linear.in_features}) is not a multiple of {ALIGN} in both dims")
                continue
            setattr(module, proj, Float8Linear.from_linear(linear))
            converted += 1
    log(f"[precision] linear: {converted} attention projections run in FP8 (rowwise e4m3)")
    return converted
