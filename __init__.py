"""nvfp4-megamoe: DeepSeek-V4 checkpoints to kernel-ready NVFP4, and a runtime that runs them."""

__version__ = "0.1.0"
