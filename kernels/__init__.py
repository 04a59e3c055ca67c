"""GPU kernels of the recipe, one idea per place:

- ``moe/``            the MoE expert backends behind one registry (``[moe] backend``), the routing
                      sort they share, the combine step and the PyTorch reference
- ``fp8/``            FP8 e4m3 building blocks: block-scaled (1 x 128, 128 x 128) and rowwise
                      quantizers, the block-scaled grouped GEMMs
- ``adamw.py``        the one-pass Triton AdamW
- ``triton_utils.py`` the interpreter switch and the helpers every Triton kernel here shares

Nothing is imported at package load, so that tests can set ``TRITON_INTERPRET`` first and a
backend's optional dependency is needed only when that backend is chosen.
"""
