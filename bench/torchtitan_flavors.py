"""Reduced-depth Qwen3-MoE flavors for upstream TorchTitan 0.2.2, registered on import.

TorchTitan 0.2.2 has no flag for the number of layers, so the head-to-head (``bench/compare.py``)
passes this module to its trainer with ``--experimental.custom_import bench.torchtitan_flavors``;
the trainer imports it before it looks the flavor up. For each of upstream's two MoE flavors it
adds ``<flavor>-<n>L`` for every depth n from 1 to the full depth, e.g. ``30B-A3B-4L``,
``30B-A3B-8L``, ``235B-A22B-1L``:

* ``n_layers`` is n; every other argument (shapes, router, rope_theta, vocab, eos_id) is upstream's,
  so the model is the one upstream would train, only shallower. ``rope_theta`` stays upstream's
  (1e6 for 30B-A3B, 5e6 for 235B-A22B, the -2507 release); ``bench/compare.py`` passes the same
  value to our trainer.
* ``max_seq_len`` of ``235B-A22B`` is raised from 4096 to 262144, the 30B flavor's value and the
  -2507 release's context. Upstream's ``update_from_config`` sets ``max_seq_len`` to
  ``[training] seq_len`` anyway, so this changes no tensor; it only keeps a seq len of 16384 from
  being logged as "exceeds original maximum" on the 235B proxy.

Importing this module needs ``torchtitan`` (0.2.2) and nothing else of this project.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.qwen3 import qwen3_args

BASE_FLAVORS = ("30B-A3B", "235B-A22B")
MAX_SEQ_LEN = 262144


def flavor_name(base: str, n_layers: int) -> str:
    """The registered name of ``base`` cut to ``n_layers`` blocks, e.g. ``30B-A3B-4L``."""
    return f"{base}-{n_layers}L"


def register() -> list[str]:
    """Add the reduced-depth flavors to ``qwen3_args`` (idempotent); returns their names."""
    names = []
    for base in BASE_FLAVORS:
        args = qwen3_args[base]
        for n in range(1, args.n_layers + 1):
            name = flavor_name(base, n)
            # A copy of MoEArgs too: update_from_config mutates it, and it must not be shared
            # with upstream's own flavor.
            qwen3_args[name] = dataclasses.replace(
                args, n_layers=n, max_seq_len=max(args.max_seq_len, MAX_SEQ_LEN),
                moe_args=dataclasses.replace(args.moe_args))
            names.append(name)
    return names


register()
