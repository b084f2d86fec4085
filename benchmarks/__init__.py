"""What bench.py measures with, beside its command lines: kernels.py times the attention and
encode kernels alone (GPU only)."""
