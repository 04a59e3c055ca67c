"""Upstream TorchTitan's trainer as rank 0 of an N-rank job in one process, for ``bench.compare
--simulate-world N``: upstream timed at the per-rank shapes our ``[parallelism] simulate_world_size``
runs, in the same call.

    python -m bench.titan_simulated 8 --job.config_file <torchtitan.toml> [torchtitan arguments]

The process joins the loopback process group of ``parallelisms/simulate.py`` (every collective
completes locally: all-gathers repeat this rank's shard, all-to-alls return what was sent) before
TorchTitan starts; TorchTitan 0.2.2's ``init_distributed`` keeps a group that already exists, so
its FSDP2 and expert-parallel code run as on rank 0 of N, with its own meshes, sharding and
compile. Upstream's dropless all-to-all exchanges its split sizes first; under loopback what this
rank receives equals what it sends, a symmetric exchange, so it runs and every routed slot is
computed once, by this rank's expert of the same local index, as in ours (checked on CPU against
upstream's own ExpertParallel: tests/test_compare.py, where torchtitan is installed).

One difference from ours: upstream shards each router gate over its experts, so the all-gather of
N copies of this rank's rows ties the logits of experts that share a local index (all of them when
a shard holds one row, as at 235B on 128 ranks) and routing concentrates on those copies. A rank
still computes T x top-k rows, so its FLOPs are a real rank's, but its experts' row counts are
less even than a trained router's. (Ours shards the router on its model dim in a simulated world.)
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from parallelisms.simulate import init_simulated_world


def simulation_line(world_size: int) -> str:
    return (f"simulating rank 0 of {world_size} ranks in one process (upstream TorchTitan, loopback "
            "collectives: no communication; the local copies standing in for it are in the step times)")


def _torchtitan_main() -> None:
    from torchtitan.train import Trainer, main

    main(Trainer)


def main(argv: list[str] | None = None, entry: Callable[[], None] = _torchtitan_main) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].isdigit() or int(argv[0]) < 2:
        print("usage: python -m bench.titan_simulated N [torchtitan arguments], N >= 2 simulated ranks",
              file=sys.stderr)
        return 2
    world_size = int(argv[0])
    init_simulated_world(world_size)
    # What torchrun would set for rank 0; TorchTitan reads LOCAL_RANK for its device.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    print(simulation_line(world_size), flush=True)
    sys.argv = ["torchtitan.train", *argv[1:]]
    entry()
    return 0


if __name__ == "__main__":
    sys.exit(main())
