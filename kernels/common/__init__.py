"""The ground floor of ``kernels/``: what the MoE backends (``kernels/moe``) and the FP8 building
blocks (``kernels/fp8``) share. It imports nothing from either, nor from outside ``kernels``.

- ``triton_utils.py`` the interpreter switch and the ``@triton.jit`` helpers every kernel inlines
                      (fp32-accumulating dot, output cast, tile prologues, K-step loads)
- ``routing.py``      expert-sorted order of the routed slots and the static tile table the grouped
                      GEMMs walk (no host sync), and the gather of rows into that order
- ``tiles.py``        :class:`~kernels.common.tiles.TileConfig` and the launch of an M-tiled GEMM
                      over the tile table

Import order inside: ``triton_utils`` <- ``routing`` <- ``tiles``. Nothing is imported at package
load, so that tests can set ``TRITON_INTERPRET`` first.
"""
