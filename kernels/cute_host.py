"""Host glue shared by the CuTeDSL kernels: torch -> CuTe tensors, a compile cache, launches.

Kernel objects expose ``key()`` (their static configuration); a compiled kernel is cached
in-process by (class, key, operand dtypes and ranks), with shapes left dynamic, so one compile
serves every token count. With ``CUTE_DSL_ARCH=sm_90a`` and CPU tensors :func:`compile_op`
builds the sm_90a binary without a GPU (the CI compile tests).
"""

from __future__ import annotations

from typing import Callable

import torch

_COMPILED: dict[tuple, Callable] = {}


def to_cute(t: torch.Tensor):
    """A torch tensor as a CuTe tensor (16-byte alignment when the pointer allows; dynamic layout)."""
    from cutlass.cute.runtime import from_dlpack

    align = 16 if t.data_ptr() % 16 == 0 else t.element_size()
    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def current_stream():
    """The current torch CUDA stream as a CUDA driver stream."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def compile_op(op, tensors: list[torch.Tensor], stream=None) -> Callable:
    """Compile ``op`` for these tensors' dtypes and ranks (shapes stay dynamic), cached in-process."""
    key = (type(op).__name__, op.key(), tuple((t.dtype, t.dim()) for t in tensors))
    fn = _COMPILED.get(key)
    if fn is None:
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute

        fn = cute.compile(op, *[to_cute(t) for t in tensors], stream if stream is not None else cuda.CUstream(0))
        _COMPILED[key] = fn
    return fn


def launch(op, tensors: list[torch.Tensor]) -> None:
    """Compile once (:func:`compile_op`), then launch on the current stream."""
    stream = current_stream()
    compile_op(op, tensors, stream)(*[to_cute(t) for t in tensors], stream)


def expect(cond: bool, msg: str) -> None:
    """Host-side argument check: raise ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)
