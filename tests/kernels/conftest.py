"""Kernel tests: on a machine without a GPU, Triton-lang kernels run in Triton's CPU interpreter.

Triton decides between compiling and interpreting when a kernel is defined (module import), so the switch is set
here, before any test module of this folder imports ``dhisparse.kernels.triton_mla``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
