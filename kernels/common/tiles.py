"""How a tiled Triton GEMM kernel is shaped and launched: :class:`TileConfig` (block sizes, warps,
pipeline stages) and the launch arguments of an M-tiled grouped GEMM over the tile table of
:mod:`kernels.common.routing`.

The configs are frozen values passed down explicitly (each backend keeps its own table of them,
e.g. ``kernels/moe/mega/configs.py``); nothing here is process state.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kernels.common.routing import max_tiles, tile_table
from kernels.common.triton_utils import interpreting


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One Triton GEMM kernel's tile (``block_m`` x ``block_n`` outputs, ``block_k`` deep per K step)
    and its launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    # dh only: 2 runs its SwiGLU-backward epilogue one column half at a time (fewer live registers).
    epilogue_split: int = 1
    # M-tiled kernels only: p > 0 launches p programs per SM that loop over the tiles, with the tile
    # loop flattened so the next tile's loads overlap this tile's epilogue; 0 = one program per tile.
    persistent: int = 0


def launch_options(cfg: TileConfig) -> dict:
    """The launch options (warps, pipeline stages) of a kernel at ``cfg``."""
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def m_tiled_launch(
    offsets_E1: torch.Tensor, num_rows: int, num_n: int, cfg: TileConfig, tiles: torch.Tensor | None = None
) -> tuple[tuple[int], torch.Tensor, int, dict]:
    """Launch arguments of an M-tiled GEMM kernel (gate_up, down, dh, dx) over ``num_rows`` expert-sorted
    rows with ``num_n`` N-tiles: (grid, tile table, its number of tiles, keyword arguments).

    ``tiles`` is a :func:`~kernels.common.routing.tile_table` of ``cfg.block_m`` to reuse, or None to
    build one. The keyword arguments are the block sizes, the loop arguments and the launch options.
    Every program loops ``for work in range(pid, num_work, NUM_PROGS)`` over the real tiles only. With
    ``cfg.persistent`` = p > 0 the grid is p programs per SM and the loop is flattened
    (``tl.range(..., flatten=True)``) so that the next tile's loads are issued during this tile's
    epilogue; with 0 the grid is the static bound (one program per possible tile), surplus programs
    skip the loop. Under the interpreter a persistent grid is 3 programs, to exercise the loop.
    """
    n_tiles = max_tiles(num_rows, offsets_E1.numel() - 1, cfg.block_m)
    if tiles is None:
        tiles = tile_table(offsets_E1, num_rows, cfg.block_m)
    total = max(n_tiles * num_n, 1)
    if cfg.persistent:
        progs = 3 if interpreting() else cfg.persistent * _num_sms(offsets_E1.device.index or 0)
        progs = min(total, progs)
    else:
        progs = total
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_PROGS=progs,
                  PERSISTENT=bool(cfg.persistent), **launch_options(cfg))
    return (progs,), tiles, n_tiles, kwargs
