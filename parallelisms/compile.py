"""torch.compile per transformer block, whole-graph (``[compile] enable``)."""

from __future__ import annotations

import sys

import torch.nn as nn

from components.config import Compile

# Inductor's compute/communication reordering, on when a compiled block holds several independent
# all-to-alls (chunked expert parallelism, ``[parallelism] expert_parallel_chunks`` > 1). Without it
# inductor keeps each wait right after its collective, so the chunks overlap nothing. With these
# three passes (CPU run, gloo, 2 ranks, mega backend, 2 chunks; generated code read with
# TORCH_LOGS=output_code, session 7): the forward's combine of chunk 0 travels under chunk 1's experts, and in
# the backward the second chunk's incoming gradient travels under the first chunk's experts, and
# each chunk's outgoing dx under the next compute; the forward's dispatch of chunk 1 still waits
# before chunk 0's experts (in a training graph each collective depends on the previous one's wait,
# which no reorder pass can lift: bench/NOTES.md, session 9). The newer pair (reorder_communication_preserving_peak_memory,
# sink_waits_iterative) overlapped one all-to-all less in the backward. Losses bitwise unchanged.
COMM_REORDER_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")


def enable_comm_reordering() -> list[str]:
    """Turn on inductor's comm/compute reordering (process-wide) with the passes of
    ``COMM_REORDER_PASSES`` this torch has; returns them (empty: none found, nothing changed)."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    passes = [name for name in COMM_REORDER_PASSES if callable(getattr(comms, name, None))]
    if passes:
        inductor_config.reorder_for_compute_comm_overlap = True
        inductor_config.reorder_for_compute_comm_overlap_passes = passes
    else:
        print(f"warning: this torch's inductor has none of the reordering passes {COMM_REORDER_PASSES}; "
              "chunked expert parallelism will not overlap its all-to-alls when compiled", file=sys.stderr)
    return passes


def apply_compile(model: nn.Module, cfg: Compile, comm_reordering: bool = False) -> None:
    """Compile each block separately with ``fullgraph=True``.

    Per block (not the whole model) because blocks are identical, so one compiled graph is reused,
    and because FSDP2 hooks sit at block boundaries. ``fullgraph`` turns any graph break, the MoE
    dispatch included, into an error instead of a silent slowdown. ``Module.compile`` compiles in
    place, so parameter names (and hence checkpoints) are the same with and without compile.
    ``comm_reordering``: the blocks carry several all-to-alls to overlap (see
    :func:`enable_comm_reordering`); inductor only.
    """
    if not cfg.enable:
        return
    if comm_reordering and cfg.backend == "inductor":
        enable_comm_reordering()
    for block in model.layers.children():
        block.compile(backend=cfg.backend, fullgraph=True)
