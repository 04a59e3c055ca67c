"""GPU kernels of the recipe, one idea per place:

- ``common/``  the ground floor both kernel folders stand on, importing neither: the interpreter
               switch and the Triton helpers every kernel shares, the routing sort and tile table
               of the grouped GEMMs, ``TileConfig``
- ``moe/``     the MoE expert backends behind one registry (``[moe] backend``), the combine step
               and the PyTorch reference
- ``fp8/``     FP8 e4m3 building blocks: block-scaled (1 x 128, 128 x 128) and rowwise quantizers,
               the block-scaled grouped GEMMs (Triton, and Gluon on Hopper behind ``engine.py``)
- ``adamw.py`` the one-pass Triton AdamW

Nothing is imported at package load, so that tests can set ``TRITON_INTERPRET`` first and a
backend's optional dependency is needed only when that backend is chosen.
"""
