"""Tile configurations of the mega-MoE kernels, chosen per problem shape from a small table.

Each Triton kernel of the op takes its block sizes, warps and pipeline stages from a
:class:`~kernels.common.tiles.TileConfig`. :func:`get_configs` returns the default
:class:`MegaMoEConfigs` for a shape ``(D, F, E)`` and dtype;
:func:`~kernels.moe.mega.forward.moe_forward` and :func:`~kernels.moe.mega.backward.moe_backward`
take a ``configs`` argument, through which the benchmark (``bench/mega_moe_gpu.py``) times
alternatives, so that the table below can be updated from measurements on the H200 without
touching the kernels. The configs are frozen values passed down explicitly; nothing here is
process state.

Kernel names (the keys of :class:`MegaMoEConfigs`):

- ``gate_up``  forward, H = [x_g @ w1[e]^T | x_g @ w3[e]^T]      M = routed rows, N = F, K = D
- ``down``     forward, Y_slot = s * (A @ w2[e]^T)                M = routed rows, N = D, K = F
- ``dh``       backward, dA' = dy_g @ w2[e] then SwiGLU backward  M = routed rows, N = F, K = D
- ``dx``       backward, dX_slot = dH @ [w1[e]; w3[e]]            M = routed rows, N = D, K = F
- ``dw13``     backward, [dW1; dW3][e] = dH_e^T @ x_e             M = 2F, N = D, K = rows of e
- ``dw2``      backward, dW2[e] = dy_e^T @ (s * A)_e              M = D, N = F, K = rows of e

For the M-tiled kernels (``gate_up``, ``down``, ``dh``, ``dx``) ``block_m`` is the row-tile of the
routing schedule; for the weight-gradient kernels ``block_k`` is the row chunk of one expert.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.common.tiles import TileConfig
from kernels.common.triton_utils import interpreting


@dataclasses.dataclass(frozen=True)
class MegaMoEConfigs:
    gate_up: TileConfig
    down: TileConfig
    dh: TileConfig
    dx: TileConfig
    dw13: TileConfig
    dw2: TileConfig
    # True: the backward's GEMMs other than the fused Triton ones run as torch._grouped_mm (cuBLAS)
    # on expert-sorted copies of dy and x made in the backward (2 x N x D transient memory, freed
    # before it returns; nothing more is saved for backward): dA' = dy_e @ w2[e] followed by the
    # SwiGLU backward as an elementwise kernel, dX as two grouped GEMMs (dgate @ w1[e], dup @ w3[e])
    # and a gather-sum over k, and the three weight gradients. Where torch._grouped_mm has no kernel
    # for the dtype (anything but bf16 on CUDA) the Triton kernels dh, dx, dw13, dw2 run instead; on
    # CPU (interpreter tests) grouped_mm's loop over the experts stands in, so both paths are tested.
    grouped_mm_backward: bool = False


# Best of the sweeps in bench/mega_moe_gpu.py on one H200 (torch 2.11, triton 3.6); the same configs
# won (or were within 5%) at both target shapes (figures in docs/mega_moe.md). dh needs its epilogue
# split in column halves to run a 128x128 tile without spilling; four operand tiles per pipeline
# stage (dx) need block_k 32 to fit 3 stages in the 227 KiB of shared memory. A persistent grid
# helps only the down GEMM (the flattened tile loop made gate_up, dh and dx slower). The cuBLAS
# backward (grouped_mm_backward) beat the Triton dh, dx and weight-gradient kernels for bf16; the
# dh, dx, dw13 and dw2 tiles are kept for fp32, which those kernels compute.
_GPU_DEFAULT = MegaMoEConfigs(
    gate_up=TileConfig(128, 128, 64, 8, 4),
    down=TileConfig(128, 256, 64, 8, 4, persistent=1),
    dh=TileConfig(128, 128, 64, 8, 4, epilogue_split=2),
    dx=TileConfig(128, 256, 32, 8, 3),
    dw13=TileConfig(128, 128, 64, 8, 4),
    dw2=TileConfig(128, 128, 64, 8, 3),
    grouped_mm_backward=True,
)

# Keyed on (D, F, E). Entries for the two target shapes; any other shape gets _GPU_DEFAULT.
_GPU_TABLE: dict[tuple[int, int, int], MegaMoEConfigs] = {
    (2048, 768, 128): _GPU_DEFAULT,  # Qwen3-30B-A3B
    (4096, 1536, 128): _GPU_DEFAULT,  # Qwen3-235B-A22B
}

# The Triton interpreter runs each program as numpy code: small blocks keep it cheap and, with the
# tiny test shapes (D 32 or 40, F 48), exercise partial tiles in every dimension, the masked K loop
# included. The weight-gradient kernels take 64 x 64 output tiles: their cost is per program, each
# program loops over the rows, and the tests' wider shapes (D 128-256) still span several tiles.
_INTERPRET_DEFAULT = MegaMoEConfigs(
    # Persistent loops in two of the four M-tiled kernels, one-program-per-tile in the others: the
    # tests cover both launch modes.
    gate_up=TileConfig(16, 32, 32, 4, 1, persistent=1),
    down=TileConfig(16, 32, 32, 4, 1),
    dh=TileConfig(16, 32, 32, 4, 1, epilogue_split=2, persistent=1),
    dx=TileConfig(16, 32, 32, 4, 1),
    dw13=TileConfig(64, 64, 16, 4, 1),
    dw2=TileConfig(64, 64, 16, 4, 1),
)


def get_configs(D: int, F: int, E: int, dtype: torch.dtype = torch.bfloat16) -> MegaMoEConfigs:
    """Default tile configs for model dim D, expert hidden dim F, E experts and activation dtype."""
    if interpreting():
        return _INTERPRET_DEFAULT
    configs = _GPU_TABLE.get((D, F, E), _GPU_DEFAULT)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory of bf16 ones: halve the K step to stay in it.
        halve = {
            f.name: dataclasses.replace(c, block_k=max(16, c.block_k // 2))
            for f in dataclasses.fields(configs)
            if isinstance(c := getattr(configs, f.name), TileConfig)
        }
        configs = dataclasses.replace(configs, **halve)
    return configs

