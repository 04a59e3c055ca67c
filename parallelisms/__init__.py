"""How a model is spread over devices, applied in a fixed order to the meta-device model:
expert parallelism, compile, activation checkpointing, FSDP2.

Compile comes before (inside) activation checkpointing, unlike TorchTitan: with the expert weights
as DTensors, AOT autograd cannot trace a checkpointed region that takes them as inputs, while a
checkpoint around the compiled block recomputes it like any other function."""

from __future__ import annotations

import torch
import torch.nn as nn

from components.config import JobConfig
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.parallel_dims import ParallelDims


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg: JobConfig, distributed: bool) -> None:
    if dims.ep_enabled:
        from parallelisms.expert_parallel import apply_ep

        dtype = torch.bfloat16 if cfg.training.mixed_precision_param == "bfloat16" else torch.float32
        apply_ep(model, dims.mesh, cfg.parallelism.expert_capacity_factor, dtype,
                 cfg.experimental.expert_parallel_chunks)
    # Chunked EP's all-to-alls only overlap in a compiled block with inductor's comm reordering on.
    apply_compile(model, cfg.compile, comm_reordering=dims.ep_enabled and cfg.experimental.expert_parallel_chunks > 1)
    apply_ac(model, cfg.activation_checkpoint)
    if distributed:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(model, dims, cfg.parallelism, cfg.training.mixed_precision_param)
