"""Test-session set-up that must happen before any test module is collected."""

import os

import torch

# Without CUDA, Triton kernels are tested through Triton's interpreter. Triton reads the variable
# when it is first imported (transformers may import it during collection), so set it here first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
