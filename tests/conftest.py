"""Tests import the engine's modules from the repository root (nothing is installed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
