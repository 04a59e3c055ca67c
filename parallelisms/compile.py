"""torch.compile per transformer block, whole-graph (``[compile] enable``)."""

from __future__ import annotations

import sys

import torch.nn as nn

from components.config import Compile

# Inductor's compute/communication reordering, on when a compiled block holds several independent
# all-to-alls (chunked expert parallelism, ``[experimental] expert_parallel_chunks`` > 1): without it
# inductor keeps each wait right after its collective and the chunks overlap nothing. In a training
# graph each collective also depends on the previous collective's wait, which no builtin pass lifts,
# so ``unchained_reorder`` runs these builtin passes with those dependencies lifted, then sinks each
# wait and the compute reading it down to its first reader (docs/expert_parallel.md).
# reorder_compute_for_overlap is left out: with CPU cost estimates it pulled waits back up.
COMM_REORDER_PASSES = ("raise_comms", "sink_waits")


def _collective_names(snodes) -> list[str]:
    from torch._inductor.utils import contains_collective

    return [sn.get_name() for sn in snodes if contains_collective(sn)]


def _sink_after_waits(order: list, is_collective=None, is_wait=None) -> list:
    """``order`` with each wait, and every node downstream of a wait, moved down to just before its
    first reader that is not (to the end if none): collectives and the nodes they do not depend on
    through a wait keep their places. sink_waits alone is greedy (once only waits are ready it emits
    them all), and the compute reading a combine's result stayed above the next chunk's experts: chunk
    0's combine wait then came before chunk 1's experts. Here the experts of a chunk go just before its
    combine, which is the first collective that reads them, and the combine's reduction goes below.
    ``is_collective`` / ``is_wait`` default to inductor's tests (tests pass their own for stand-ins)."""
    from torch._inductor.utils import contains_collective, contains_wait

    contains_collective = is_collective or contains_collective
    contains_wait = is_wait or contains_wait
    made_by = {b: sn for sn in order for b in sn.get_buffer_names()}
    sinkable = set()
    for sn in order:  # a topological order: a node's producers come before it
        if contains_collective(sn):
            continue
        if contains_wait(sn) or any(made_by.get(d.name) in sinkable for d in sn.unmet_dependencies):
            sinkable.add(sn)
    readers = {sn: [] for sn in order}
    for sn in order:
        for d in sn.unmet_dependencies:
            if d.name in made_by and made_by[d.name] is not sn:
                readers[made_by[d.name]].append(sn)
    pos = {sn: i for i, sn in enumerate(order)}
    deadline = {}
    for sn in reversed(order):
        if sn in sinkable:
            deadline[sn] = min((deadline[r] if r in sinkable else pos[r] for r in readers[sn]), default=len(order))
    before = {}  # position of an anchored node -> the sinkable nodes to put just before it, in order
    for sn in order:
        if sn in sinkable:
            before.setdefault(deadline[sn], []).append(sn)
    out = []
    for i, sn in enumerate(order):
        if sn not in sinkable:
            out.extend(before.get(i, []))
            out.append(sn)
    out.extend(before.get(len(order), []))
    return out if _respects_dependencies(out) else order


def _respects_dependencies(order: list) -> bool:
    """Every node after the nodes whose buffers it depends on (those in ``order``)."""
    made = {b: pos for pos, sn in enumerate(order) for b in sn.get_buffer_names()}
    return all(made.get(dep.name, -1) < pos for pos, sn in enumerate(order) for dep in sn.unmet_dependencies)


def unchained_reorder(snodes: list) -> list:
    """An inductor reorder pass (a callable in ``reorder_for_compute_comm_overlap_passes``): the
    builtin ``COMM_REORDER_PASSES`` with each collective's ordering dependencies on waits lifted
    while they run, restored after.

    Why: inductor chains every collective after the previous one, so that all ranks issue them in
    one order; in a training graph the wait is lowered as a mutation of the collective's output, the
    chain is renamed onto it, and each collective then waits for the previous one's *wait*. The
    returned order must keep the collectives in their original order (raise_comms schedules them by
    it); if it does not, the passes' order with the dependencies in place is returned instead.
    """
    import torch._inductor.comms as comms
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.utils import contains_collective, contains_wait

    def run(nodes):
        for name in COMM_REORDER_PASSES:
            nodes = getattr(comms, name)(nodes)
        return nodes

    wait_bufs = {b for sn in snodes if contains_wait(sn) for b in sn.get_buffer_names()}
    saved = {}
    for sn in snodes:
        if contains_collective(sn):
            lifted = {d for d in sn.unmet_dependencies if isinstance(d, WeakDep) and d.name in wait_bufs}
            if lifted:
                saved[sn] = sn.unmet_dependencies
                sn.unmet_dependencies = sn.unmet_dependencies - lifted
    try:
        order = _sink_after_waits(run(snodes))
    finally:
        for sn, deps in saved.items():
            sn.unmet_dependencies = deps
    if _collective_names(order) != _collective_names(snodes):
        return run(snodes)
    return order


def enable_comm_reordering() -> list[str]:
    """Turn on inductor's comm/compute reordering (process-wide) with :func:`unchained_reorder`;
    returns the builtin passes it runs (empty: this torch lacks one, nothing changed)."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    missing = [name for name in COMM_REORDER_PASSES if not callable(getattr(comms, name, None))]
    if missing:
        print(f"warning: this torch's inductor lacks the reordering passes {missing}; chunked expert "
              "parallelism will not overlap its all-to-alls when compiled", file=sys.stderr)
        return []
    inductor_config.reorder_for_compute_comm_overlap = True
    inductor_config.reorder_for_compute_comm_overlap_passes = [unchained_reorder]
    return list(COMM_REORDER_PASSES)


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
