"""The training loss over the model's logits: token cross-entropy (:func:`cross_entropy_loss`,
compiled by the trainer with [compile] enable). With ``[training] loss_chunk_size`` > 0 the model
computes the loss itself, fused with its output projection (``models/loss.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, in float32, of (B, L, V) logits of any float dtype.

    Eager, the float32 copy of the logits, their log-probabilities and the gradient are each a
    full (B*L, V) float32 tensor (10 GiB at seq len 16384 with Qwen3's vocabulary). Compiled (the
    trainer compiles it when [compile] enable is set, as TorchTitan compiles its loss), inductor
    fuses the upcast, log-softmax and NLL into reductions over the bf16 logits and writes their
    bf16 gradient in one pass.
    """
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), labels_BL.flatten())


def build_loss_fn(compile_enable: bool, backend: str):
    """:func:`cross_entropy_loss`, compiled (whole graph) when the model's blocks are."""
    if not compile_enable:
        return cross_entropy_loss
    return torch.compile(cross_entropy_loss, backend=backend, fullgraph=True)
