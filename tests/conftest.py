import os

import torch

# Without a GPU, Triton kernels run through Triton's CPU interpreter. The variable must be set
# before triton is first imported (importing torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
