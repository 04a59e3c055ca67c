"""torch.compile per transformer block, whole-graph (``[compile] enable``)."""

from __future__ import annotations

import torch.nn as nn

from components.config import Compile


def apply_compile(model: nn.Module, cfg: Compile) -> None:
    """Compile each block separately with ``fullgraph=True``.

    Per block (not the whole model) because blocks are identical, so one compiled graph is reused,
    and because FSDP2 hooks sit at block boundaries. ``fullgraph`` turns any graph break, the MoE
    dispatch included, into an error instead of a silent slowdown. ``Module.compile`` compiles in
    place, so parameter names (and hence checkpoints) are the same with and without compile.
    """
    if not cfg.enable:
        return
    for block in model.layers.children():
        block.compile(backend=cfg.backend, fullgraph=True)
