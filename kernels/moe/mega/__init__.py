"""The ``mega`` MoE backend: routed experts as fused Triton grouped GEMMs (Hopper-first).

Data path, in reading order:

- ``kernels/common/routing.py``  expert-sorted order of the (token, k) slots and the static tile
  schedule (shared with the FP8 kernels)
- ``forward.py``  gathered gate/up GEMM + SwiGLU, weighted down GEMM, reduction over k
- ``backward.py`` dH (with the routing-weight gradient), dX, and the grouped weight gradients
- ``op.py``       the ``torch.library`` custom ops, their autograd and the public :func:`mega_moe`
- ``configs.py``  tile configs per shape: frozen values that ``moe_forward`` / ``moe_backward`` take

Importing this package registers the backend under the name ``"mega"``.
"""

from kernels.moe.mega.backward import moe_backward
from kernels.moe.mega.configs import MegaMoEConfigs, get_configs
from kernels.moe.mega.forward import moe_forward
from kernels.moe.mega.op import mega_moe

__all__ = ["MegaMoEConfigs", "get_configs", "mega_moe", "moe_backward", "moe_forward"]
