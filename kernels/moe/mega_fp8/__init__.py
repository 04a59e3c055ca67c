"""The ``mega_fp8`` MoE backend: the ``mega`` op with its GEMMs in block-scaled FP8 e4m3.

Chosen by ``[moe] backend = "mega"`` with ``[precision] moe = "fp8_blockwise"``. Data path, in
reading order:

- ``forward.py``   quantize x and the weights, FP8 gate/up + SwiGLU (A written quantized), FP8 down
                   GEMM with the routing-weight combine epilogue, reduction over k
- ``backward.py``  FP8 dgrad of the down GEMM with the SwiGLU backward fused (dH written quantized),
                   FP8 dX, FP8 weight gradients
- ``op.py``        the ``torch.library`` custom ops, their autograd, the options and :func:`mega_moe_fp8`
- ``reference.py`` the same quantized pipeline in plain PyTorch (float64 GEMMs), for tests

The GEMM and quantization kernels are the building blocks of ``kernels/fp8``; which engine runs
each GEMM (Gluon or Triton) is ``kernels/fp8/engine.py``'s choice. Importing this package
registers the backend under the name ``"mega_fp8"``.
"""

from kernels.moe.mega_fp8.op import MegaFP8Options, mega_moe_fp8

__all__ = ["MegaFP8Options", "mega_moe_fp8"]
