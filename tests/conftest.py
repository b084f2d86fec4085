"""Tests import the engine's modules from the repository root (nothing is installed).

Without a GPU every Triton kernel runs under the Triton interpreter. Triton fixes that choice
when it first reads TRITON_INTERPRET, and transformers may import Triton before any kernel
module does, so the variable is set here, before anything else is imported."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests run thousands of tiny ops: a second intra-op thread only adds synchronisation, and
# on a busy runner its spin-waits cost milliseconds per op (seen: 20x slower), so use one.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
