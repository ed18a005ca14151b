"""Runnable examples: ``python -m tp_kernels.examples.<name> --help``."""
