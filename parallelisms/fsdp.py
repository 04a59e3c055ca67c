"""FSDP2 (``fully_shard``) over the data-parallel mesh, TorchTitan's recipe."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from components.config import Parallelism
from parallelisms.expert_parallel import expert_params
from parallelisms.parallel_dims import ParallelDims

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _on_model_dim(gates: set[nn.Parameter]) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP's placement function that shards ``gates`` on dim 1 (their model dim), the rest as usual."""
    return lambda p: Shard(1) if p in gates else None


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: Parallelism, param_dtype: str) -> None:
    """Shard each block, the embeddings and the final norm + output; parameters stay float32 and
    are gathered in ``param_dtype`` for compute; gradients are reduced in ``fsdp_reduce_dtype``.

    In a simulated world (``simulate_world_size``, parallelisms/simulate.py) the router gates are
    sharded on their model dim instead of their expert dim: the all-gather repeats this rank's
    shard, and repeated expert rows would tie the logits of experts on different ranks, so top-k
    would pick tied copies instead of routing as a real job does. The per-rank numel is the same.

    With expert parallelism the expert weights are left out of FSDP: ``apply_ep`` has sharded them
    already and gathers them itself (see ``parallelisms/expert_parallel.py``).
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[cfg.fsdp_reduce_dtype])
    ignored = expert_params(model)
    blocks = list(model.layers.values())
    gates = {block.moe.router.gate.weight for block in blocks} if cfg.simulate_world_size > 1 else set()
    placement = _on_model_dim(gates) if gates else None
    for i, block in enumerate(blocks):
        if cfg.fsdp_reshard_after_forward == "default":
            # The last block's parameters are needed again right away by backward.
            reshard = i < len(blocks) - 1
        else:
            reshard = cfg.fsdp_reshard_after_forward == "always"
        fully_shard(block, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored,
                    shard_placement_fn=placement)
    fully_shard(model.tok_embeddings, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard([model.norm, model.output], mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)

