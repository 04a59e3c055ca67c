"""What both checkpoint formats (DCP in components/checkpoint.py, Hugging Face safetensors in
components/hf_checkpoint.py) need from ``torch.distributed.checkpoint``: its single-process warning
dropped, and which rank writes the files every rank shares."""

from __future__ import annotations

import contextlib
import warnings

import torch


def is_main() -> bool:
    """Rank 0, or a single process: the one that writes shared files and speaks."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns at every save and load without a process group that it assumes one process: that
    is what a single-process run means, so exactly that warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield
