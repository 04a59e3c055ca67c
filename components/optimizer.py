"""AdamW and the warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from components.config import ConfigError
from components.config import LRScheduler as LRSchedulerConfig
from components.config import Optimizer as OptimizerConfig


def folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer divides gradients by its ``grad_scale`` inside its step (torch's fused
    AdamW, :class:`kernels.adamw.TritonAdamW`), so clipping can be folded into it."""
    return bool(optimizer.defaults.get("fused")) or getattr(optimizer, "folds_grad_scale", False)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights, biases and embeddings are exempt)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if impl == "triton":
        from kernels.adamw import TritonAdamW
        from kernels.common.triton_utils import interpreting

        if device_type != "cuda" and not interpreting():
            raise ConfigError(f"[optimizer] implementation = \"triton\" runs on a CUDA GPU (the device is "
                              f"{device_type}); use \"foreach\" or \"auto\"")
        return TritonAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr before optimizer step ``step`` (1-based): linear warmup, constant,
    then decay over the last ``decay_ratio`` of the steps down to ``min_lr_factor``."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        return step / (warmup + 1)
    decay_steps = round((total_steps - warmup) * cfg.decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                       cfg: LRSchedulerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR counts from 0 at construction; step s of training (1-based) uses lr_factor(s).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i + 1, total_steps, cfg))
