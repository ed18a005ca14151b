"""Small models for the end-to-end tests, the example and the benchmarks."""

from tp_kernels.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
