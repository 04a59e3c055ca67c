"""Activation checkpointing per transformer block (``[activation_checkpoint] mode`` and ``keep``)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from components.config import ActivationCheckpoint

_checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False)


def _recompute_every_op(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


# The regions around kept ops sit inside compiled blocks. There torch 2.11 tags for recomputation
# only the region's top-level graph nodes, not the ops inside autograd Functions or those the
# functional collectives decompose into, and the partitioner saves what is untagged (collective
# outputs always): under expert parallelism every layer then held the exchange's buffers and the
# gathered expert weights. A policy given per op (what torch 2.13 applies to a plain checkpoint by
# itself) tags them all.
_region_checkpoint = functools.partial(
    _checkpoint, context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_every_op))


class _NoContextFnNotice(logging.Filter):
    """Drops torch's notice that a checkpoint under compile got a ``context_fn``: it asks to check
    that the region mutates nothing in place, which matters where the policy saves op outputs, and
    this one saves none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def keeping_forward(block: nn.Module, keep: str, h_BLD: torch.Tensor, cos_Ld: torch.Tensor, sin_Ld: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``TransformerBlock``'s forward, checkpointed around the ops whose outputs are kept: the
    attention core (and with "attention_and_moe" the routed experts) run outside the checkpoints, so
    backward recomputes only the cheap regions between them. What is kept per layer: what SDPA saves
    (q, k, v, output, log-sum-exp) and what the experts' backend saves (``mega``: x and
    H = [gate | up]); what it saves is the kept ops' forward in the recomputation.

    Regions rather than a selective-checkpoint policy over aten ops: the experts are one op for
    some backends and many for others (the reference loop, expert parallelism's all-to-alls), and
    SDPA's inputs q, k, v stay held here as they are without checkpointing.
    """
    q, k, v = _region_checkpoint(block.qkv, h_BLD, cos_Ld, sin_Ld)
    attn_BHLd = block.attention.attend(q, k, v)
    if keep == "attention":
        return _region_checkpoint(block.after_attention, h_BLD, attn_BHLd)
    h_BLD, *routed = _region_checkpoint(block.after_attention_to_router, h_BLD, attn_BHLd)
    moe_BLD, router_stats_3E = block.moe.run_experts(h_BLD.shape, *routed)
    return h_BLD + moe_BLD, router_stats_3E


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap blocks so their activations are recomputed in backward.

    ``full`` wraps every block; ``selective`` every ``selective_layer_interval``-th one, trading
    memory for less recompute. Non-reentrant checkpointing, which composes with torch.compile and
    FSDP2 and lets custom ops (the MoE kernels) recompute like any other op.

    ``keep`` other than "none": a checkpointed block (the first ``keep_layers`` of them, if not 0;
    the others are wrapped whole) is not wrapped; its forward becomes
    :func:`keeping_forward`, which checkpoints the regions around the kept ops. With
    "attention_and_moe" and ``keep_moe_layers`` n > 0, only the first n of those blocks keep the
    experts; the later ones keep the attention core only. Blocks are compiled
    in place before this (``parallelisms/__init__.py``), and the compiled call looks ``forward`` up
    when it first traces, so under compile those checkpoints sit inside the compiled block.
    """
    if cfg.mode == "none":
        return
    if cfg.keep != "none":
        wrap_log = logging.getLogger("torch._higher_order_ops.wrap")
        if not any(isinstance(f, _NoContextFnNotice) for f in wrap_log.filters):
            wrap_log.addFilter(_NoContextFnNotice())
    kept = 0
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if cfg.mode == "full" or i % cfg.selective_layer_interval == 0:
            if cfg.keep != "none" and (cfg.keep_layers == 0 or kept < cfg.keep_layers):
                keep = cfg.keep
                if keep == "attention_and_moe" and cfg.keep_moe_layers and kept >= cfg.keep_moe_layers:
                    keep = "attention"
                kept += 1
                block.forward = functools.partial(keeping_forward, block, keep)
            else:
                model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
