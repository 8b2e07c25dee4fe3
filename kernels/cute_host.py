"""Host glue shared by the CuTeDSL kernels: a compile cache and launches from torch tensors.

Kernel objects expose ``key()`` (their static configuration); a compiled kernel is cached
in-process by (class, key, operand dtypes, ranks and alignments), with shapes left dynamic, so one
compile serves every token count. With ``CUTE_DSL_ARCH=sm_90a`` and CPU tensors :func:`compile_op`
builds the sm_90a binary without a GPU (the CI compile tests).

Kernels are compiled with TVM-FFI (``--enable-tvm-ffi``): the compiled function takes the torch
tensors themselves and the stream handle, and checks and converts them in C. A launch then costs
about 10 us of host time instead of about 220 us (``from_dlpack`` per tensor and CuTe's Python
argument path; measured on an H200, ``docs/design/runtime.md``), which is most of an eager
decode step's launch cost.

On disk: ``cute.compile`` bypasses CuTeDSL's own file cache, so each compiled kernel is also written
as an object file (``export_to_c``) to a folder, and later processes load it
(``cute.runtime.load_module``) instead of compiling. The folder is ``$NVFP4_MEGAMOE_KERNEL_CACHE``,
by default ``$XDG_CACHE_HOME/nvfp4_megamoe/kernels`` (``~/.cache/nvfp4_megamoe/kernels`` without
it); ``0``, ``off``, ``false``, ``none`` or an empty value turn the disk cache off. The file name hashes
the in-process key, the target, the CuTeDSL version and the source of every
module in ``kernels/``, so an edited kernel or another toolchain never loads a stale binary; a file
that fails to load is compiled again, and a folder that cannot be written warns once and leaves the
kernels in-process. :func:`start_compile_all` compiles in worker processes (:mod:`compile_workers`), which describe
CUDA operands with CuTe's fake tensors (no CUDA context in a worker) and store what they compile.
``tests/test_moe_sm90_gpu.py`` checks that loaded kernels compute what compiled ones do (passed on an H200).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

_COMPILED: dict[tuple, Callable] = {}
_COLLECTED: list[tuple[object, list[torch.Tensor]]] | None = None  # set inside ``collecting``
CACHE_ENV = "NVFP4_MEGAMOE_KERNEL_CACHE"
_CACHE_OFF = {"", "0", "off", "false", "none"}
_UNWRITABLE: set[Path] = set()  # cache folders a store failed in: warned once, not tried again
_SOURCE_DIGEST: str | None = None


def _alignment(t: torch.Tensor) -> int:
    return 16 if t.data_ptr() % 16 == 0 else t.element_size()


def to_cute(t: torch.Tensor):
    """A torch tensor as the compile-time CuTe spec of an operand (16-byte alignment when the pointer
    allows; dynamic shape and strides, unit stride innermost; passed through TVM-FFI)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=_alignment(t), enable_tvm_ffi=True).mark_layout_dynamic(
        leading_dim=t.dim() - 1)


def _source_digest() -> str:
    """sha256 of every module of this package (a kernel edit must not load an old binary), and CuTeDSL's version."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        from importlib import metadata

        h = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        try:
            h.update(metadata.version("nvidia-cutlass-dsl").encode())
        except metadata.PackageNotFoundError:  # an unpacked copy without its dist-info: its location then
            import cutlass
            h.update(str(Path(cutlass.__file__).resolve()).encode())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def cache_folder() -> Path | None:
    """The on-disk kernel cache: ``$NVFP4_MEGAMOE_KERNEL_CACHE``, else the user's cache folder; None when off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _CACHE_OFF else Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:  # the XDG spec ignores a relative XDG_CACHE_HOME
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no home folder to resolve: nowhere to keep it
        return None
    return base / "nvfp4_megamoe" / "kernels"


@functools.cache
def _device_target() -> str:
    """The GPU this process compiles for ("cpu" without one); asked once (``torch.cuda.is_available`` is not cached)."""
    return "sm_%d%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "cpu"


def _cache_file(key: tuple) -> tuple[Path, str] | None:
    """(object file, symbol prefix) of this compile in the on-disk cache, or None when it is off."""
    folder = cache_folder()
    if folder is None or folder in _UNWRITABLE:
        return None
    target = os.environ.get("CUTE_DSL_ARCH") or _device_target()
    ident = repr((key, target, _source_digest()))
    digest = hashlib.sha256(ident.encode()).hexdigest()
    return folder / f"{digest}.o", f"k{digest[:24]}"


def _load_cached(where: tuple[Path, str]) -> Callable | None:
    path, prefix = where
    try:
        if not path.is_file():
            return None
    except OSError:  # an unreadable folder (permissions): compile; the store then warns about the folder
        return None
    try:
        from cutlass.cute.runtime import load_module

        return getattr(load_module(str(path), enable_tvm_ffi=True), prefix)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: compile again, say so once
        warnings.warn(f"{path}: cached kernel did not load ({exc}); compiling it again", stacklevel=3)
        return None


def _store_cached(where: tuple[Path, str], fn) -> None:
    path, prefix = where
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fn.export_to_c(str(tmp), prefix)  # an object file whatever the suffix
        os.replace(tmp, path)  # another process writing the same kernel writes the same bytes
    except OSError as exc:  # read-only, full, not a folder: every later store would fail the same way
        _UNWRITABLE.add(path.parent)
        warnings.warn(f"kernel cache {path.parent} is not writable ({exc}); compiled kernels stay in this "
                      f"process only (set {CACHE_ENV} to another folder, or to 0 to turn the disk cache off)",
                      stacklevel=3)
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: the compiled kernel still serves
        warnings.warn(f"{path}: could not cache the compiled kernel ({exc})", stacklevel=3)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def compile_key(op, tensors: list[torch.Tensor]) -> tuple:
    """What a compiled function is specialised on: the op's configuration and each operand's dtype, rank, alignment
    and device type (a function compiled for CPU tensors, as the CI's sm_90a builds are, refuses CUDA ones)."""
    return type(op).__name__, op.key(), tuple((t.dtype, t.dim(), _alignment(t), t.device.type) for t in tensors)


def compile_described(op, operands: list) -> Callable:
    """``cute.compile`` of ``op`` for operands already described to CuTe (:func:`to_cute` tensors or fake ones),
    with TVM-FFI; no cache."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    # the stream is an argument, not TVM-FFI's environment stream: that one needs GPU tensors at compile time, and
    # the CI compiles with CPU tensors
    return cute.compile(op, *operands, make_fake_stream(), options="--enable-tvm-ffi")


def compile_op(op, tensors: list[torch.Tensor]) -> Callable | None:
    """Compile ``op`` for these tensors' dtypes, ranks and alignments (shapes stay dynamic), cached
    in-process and on disk. The result is called as ``fn(*tensors, stream_handle)``. Inside :func:`collecting`
    nothing is compiled: the (op, tensors) pair is listed and None returned."""
    if _COLLECTED is not None:
        _COLLECTED.append((op, tensors))
        return None
    key = compile_key(op, tensors)
    fn = _COMPILED.get(key)
    if fn is None:
        where = _cache_file(key)
        fn = _load_cached(where) if where else None
        if fn is None:
            fn = compile_described(op, [to_cute(t) for t in tensors])
            if where:
                _store_cached(where, fn)
        _COMPILED[key] = fn
    return fn


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[object, list[torch.Tensor]]]]:
    """``with collecting() as jobs:``: every :func:`compile_op` call in the block appends (op, tensors) to ``jobs``
    instead of compiling (a warm-up that only compiles can thus say what it needs). Not for launches."""
    global _COLLECTED
    outer, _COLLECTED = _COLLECTED, []
    try:
        yield _COLLECTED
    finally:
        _COLLECTED = outer


def _operand_spec(t: torch.Tensor) -> tuple:
    """What a worker needs to make an operand with the same compile key (``compile_key``)."""
    return tuple(t.shape), t.dtype, t.device.type, _alignment(t) == 16


def _operand(spec: tuple):
    """A worker's stand-in for an operand. CPU: a tensor (as the CI's compiles take). CUDA: CuTe's fake tensor in
    global memory, of the dtype, rank and alignment that the spec gives, dynamic shapes and strides with the
    innermost stride 1, as :func:`to_cute` describes a CUDA tensor: the same machine code, and the compiled
    function checks for CUDA operands, without a CUDA context in the worker (each one would take GPU memory and
    time at every cold start)."""
    shape, dtype, device, aligned = spec
    if device != "cuda":
        n = math.prod(shape)
        flat = torch.empty(n + (0 if aligned else 1), dtype=dtype, device=device)
        return to_cute((flat if aligned else flat[1:]).view(shape))  # one element off: not 16-byte aligned
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_tensor

    element = from_dlpack(torch.empty(1, dtype=dtype)).element_type  # CuTe's type for the dtype, as to_cute maps it
    rank = len(shape)
    return make_fake_tensor(element, tuple(cute.sym_int() for _ in range(rank)),
                            tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
                            assumed_align=16 if aligned else dtype.itemsize)


def _compile_share(jobs: list[tuple[object, list[tuple], tuple[Path, str]]]) -> int:
    """A worker process: compile each (op, operand specs) job and store it in the disk cache where the parent
    process said (its file name is the parent's key: the worker's stand-ins are not tensors of the parent's)."""
    for op, specs, where in jobs:
        _store_cached(where, compile_described(op, [_operand(spec) for spec in specs]))
    return len(jobs)


class PendingCompiles:
    """Kernels compiling in worker processes (:func:`start_compile_all`); :meth:`wait` finishes them."""

    def __init__(self, todo: dict[tuple, tuple], stored: list[tuple], processes: int | None, pool=None):
        self._todo, self._done, self._error = todo, [], None
        self._stop = threading.Event()
        from nvfp4_megamoe.kernels.compile_workers import worker_count

        workers = min(len(stored), worker_count(processes))
        self._thread = None
        if workers <= 1:
            if pool is not None:
                pool.discard()
            return
        # the longest compiles first, so that no worker is left with a long one at the end
        order = sorted(stored, key=lambda job: getattr(job[0], "compile_cost", 1), reverse=True)
        specs = [(op, [_operand_spec(t) for t in tensors], where) for op, tensors, where in order]
        self._thread = threading.Thread(target=self._run, args=(specs, pool, workers), name="kernel-compiles",
                                        daemon=True)
        self._thread.start()

    def _run(self, specs: list[tuple], pool, workers: int) -> None:
        from nvfp4_megamoe.kernels.compile_workers import WorkerPool, run_jobs

        try:
            self._done = run_jobs(specs, pool if pool is not None else WorkerPool(workers), self._stop)
        except Exception as exc:  # noqa: BLE001 - no workers (cannot start, a job that does not pickle): compile here
            self._error = exc

    def cancel(self) -> None:
        """Hand out no more jobs and wait for those running (each worker then exits); nothing is loaded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self, report: list | None = None) -> int:
        """Wait for the workers, then load what they stored (compiling here whatever they could not); returns how
        many jobs were compiled (not found cached). ``report`` receives a :class:`compile_workers.Compiled` a job."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                warnings.warn(f"parallel kernel compilation failed ({self._error}); compiling in this process",
                              stacklevel=2)
            failed = [c for c in self._done if c.error]
            if failed:  # their kernels are compiled here, below
                warnings.warn(f"{len(failed)} of {len(self._done)} kernels failed to compile in worker processes "
                              f"({failed[0].name}: {failed[0].error}); compiling them in this process", stacklevel=2)
            if report is not None:
                report.extend(self._done)
        for op, tensors, _ in self._todo.values():
            compile_op(op, tensors)  # from the disk cache where a worker stored it
        return len(self._todo)


def start_compile_all(jobs: list[tuple[object, list[torch.Tensor]]], processes: int | None = None,
                      pool=None) -> PendingCompiles:
    """Start compiling every (op, tensors) job not compiled yet: in up to ``processes`` worker processes (default: the
    CPU cores), or those of ``pool`` (a :class:`compile_workers.WorkerPool` started earlier, closed here when no job
    needs it), driven from a thread of this process, when the disk cache is on and more than one job is left (the
    workers store the object files that :meth:`PendingCompiles.wait` then loads); otherwise ``wait`` compiles them
    here, one after the other. This process is free meanwhile (``load_model`` reads the weights)."""
    todo: dict[tuple, tuple] = {}
    for op, tensors in jobs:
        key = compile_key(op, tensors)
        where = _cache_file(key)
        cached = key in _COMPILED or (where is not None and where[0].is_file())
        if not cached:
            todo.setdefault(key, (op, tensors, where))
    # a worker's kernel reaches this process through the disk cache: none without one
    stored = [job for job in todo.values() if job[2] is not None]
    return PendingCompiles(todo, stored, len(pool.channels) if pool is not None else processes, pool)


def compile_all(jobs: list[tuple[object, list[torch.Tensor]]], processes: int | None = None,
                report: list | None = None) -> int:
    """:func:`start_compile_all`, then wait for it: returns how many jobs were compiled (not found cached)."""
    return start_compile_all(jobs, processes).wait(report)


def launch(op, tensors: list[torch.Tensor]) -> None:
    """Compile once (:func:`compile_op`), then launch on the current stream."""
    compile_op(op, tensors)(*tensors, torch.cuda.current_stream().cuda_stream)


def expect(cond: bool, msg: str) -> None:
    """Host-side argument check: raise :class:`~nvfp4_megamoe.errors.KernelArgumentError` (a ``ValueError``)
    with ``msg`` unless ``cond``."""
    if not cond:
        from nvfp4_megamoe.errors import KernelArgumentError

        raise KernelArgumentError(msg)
