"""Block-scaled FP8 (e4m3) building blocks for the MoE, DeepSeek-V3 style (issue 6).

- ``quant.py``         1 x 128 (activations, gradients), 128 x 1 (wgrad operands, grouped by expert)
                       and 128 x 128 (weights) quantization, with torch references
- ``grouped_gemm.py``  FP8 grouped GEMMs over the expert-sorted rows of ``kernels.moe.routing``

Import the submodules directly; this package imports nothing at load so that tests can set
``TRITON_INTERPRET`` first.
"""
