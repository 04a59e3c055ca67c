"""FP8 (e4m3) building blocks (docs/fp8.md).

- ``blockwise.py``     DeepSeek-V3 style block scales: 1 x 128 (activations, gradients), 128 x 1
                       (weight-gradient operands, grouped by expert) and 128 x 128 (weights)
                       quantization, with torch references
- ``grouped_gemm.py``  block-scaled FP8 grouped GEMMs over the expert-sorted rows of
                       ``kernels.common.routing``
- ``hopper_*.py``      their warp-specialized Gluon versions for sm_90 (gate/up, M-grouped,
                       K-grouped wgrad), on the engine of ``gluon_base.py``
- ``engine.py``        the one place that picks Gluon or Triton for each GEMM call
- ``rowwise.py``       one scale per row (TorchTitan's method): the quantizer and the dense
                       ``fp8_linear`` custom op of the attention projections

Import the submodules directly; this package imports nothing at load so that tests can set
``TRITON_INTERPRET`` first.
"""
