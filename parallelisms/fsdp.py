"""FSDP2 (``fully_shard``) over the data-parallel mesh, TorchTitan's recipe."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from components.config import Parallelism
from parallelisms.expert_parallel import expert_params
from parallelisms.parallel_dims import ParallelDims

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: Parallelism, param_dtype: str) -> None:
    """Shard each block, the embeddings and the final norm + output; parameters stay float32 and
    are gathered in ``param_dtype`` for compute; gradients are reduced in ``fsdp_reduce_dtype``.

    With expert parallelism the expert weights are left out of FSDP: ``apply_ep`` has sharded them
    already and gathers them itself (see ``parallelisms/expert_parallel.py``).
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[cfg.fsdp_reduce_dtype])
    ignored = expert_params(model)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if cfg.fsdp_reshard_after_forward == "default":
            # The last block's parameters are needed again right away by backward.
            reshard = i < len(blocks) - 1
        else:
            reshard = cfg.fsdp_reshard_after_forward == "always"
        fully_shard(block, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(model.tok_embeddings, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard([model.norm, model.output], mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)

