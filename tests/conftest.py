"""Suite-wide set-up. Without a GPU, Triton kernels run in its interpreter; Triton reads the
variable when it is first imported, so it is set here, before any test module can import it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
