"""The guard shared by the test modules of Triton kernels.

Without a GPU the kernels run in Triton's CPU interpreter, which ``tests/conftest.py`` selects
(``TRITON_INTERPRET=1``) before anything imports triton. A kernel module imported before that (a
test file run outside pytest, a plugin importing triton early) holds GPU-compiled kernels that
cannot run here: its tests are skipped with a message rather than failing obscurely.
"""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def skip_unless_runnable(kernel, package: str) -> None:
    """Skip the calling test module if ``kernel`` (a ``triton.jit`` function of ``package``) can
    run neither on a GPU nor in the interpreter."""
    if not HAS_CUDA and type(kernel).__name__ != "InterpretedFunction":
        pytest.skip(
            f"{package} was imported before TRITON_INTERPRET=1 was set; run the tests through pytest "
            "(tests/conftest.py sets it) or export TRITON_INTERPRET=1",
            allow_module_level=True,
        )
