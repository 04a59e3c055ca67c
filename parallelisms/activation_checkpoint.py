"""Activation checkpointing per transformer block (``[activation_checkpoint] mode``)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from components.config import ActivationCheckpoint


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap blocks so their activations are recomputed in backward.

    ``full`` wraps every block; ``selective`` every ``selective_layer_interval``-th one, trading
    memory for less recompute. Non-reentrant checkpointing, which composes with torch.compile and
    FSDP2 and lets custom ops (the MoE kernels) recompute like any other op.

    ``keep`` other than "none": a checkpointed block is not wrapped; it checkpoints the regions
    around its attention core (and routed experts) itself, so those ops' outputs are kept and only
    the cheap regions between them are recomputed (``TransformerBlock._forward_keeping``). Under
    compile those checkpoints sit inside the compiled block (dynamo traces them).
    """
    if cfg.mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if cfg.mode == "full" or i % cfg.selective_layer_interval == 0:
            if cfg.keep != "none":
                # The block checkpoints the regions between the kept ops itself.
                block.ac_keep = cfg.keep
            else:
                model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
