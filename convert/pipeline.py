"""Running the plan's units: their pieces (experts, stretches of copied tensors) on a pool of worker threads.

Pieces are handed out in plan order, as many at once as the workers and the memory budget allow, so a
layer's experts convert side by side and the output shards fill roughly front to back (their running
sha256 follows close behind, ``hashing.PrefixHash``). Each piece writes its own byte ranges at offsets
the plan fixed, so the bytes do not depend on the number of workers or the order pieces finish in;
a unit's record (error figures, counts) is taken from its pieces' results in piece order once the
last one is in (``Unit.finish``), so neither does the manifest.

The numerics are torch ops, which release the GIL while they run, on one intra-op thread per worker
(``threads_for_run``): the workers are the parallelism, and torch's float reductions, whose rounding
depends on their thread count, give the same error figures whatever the number of workers.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .errors import ConvertError, SourceError
from .memory import MEMORY_BUDGET, TRIM_ABOVE, TRIM_AFTER, MemoryBudget, anon_resident, piece_bytes, release_memory
from .timing import stage
from .units import Unit

if TYPE_CHECKING:
    from .hub import HubSource
    from .source import LocalSource
    from .staging import Stager
    from .writer import ShardWriter

    Source = LocalSource | HubSource


def conversion_device(name: str | torch.device) -> torch.device:
    """The device the FP8 and MXFP4 numerics run on: the CPU, or a CUDA GPU that is there (``cuda``, ``cuda:N``)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConvertError(f"--device {name!r} is not a device; use cpu or cuda (cuda:N for the GPU numbered N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConvertError(f"--device {name}: the converter runs on cpu or cuda, not {device.type}")
    if not torch.cuda.is_available():
        raise ConvertError(f"--device {name}: no CUDA GPU is available to this process (torch {torch.__version__}, "
                           f"built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}); "
                           "convert on the CPU (leave --device out): the output is the same")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConvertError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    return device


@contextmanager
def threads_for_run() -> Iterator[None]:
    """torch's intra-op threads for the run: one (each worker's torch ops run on its own thread; more would
    contend with the other workers and the hashing, and change the rounding of float reductions)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def unit_error(unit: Unit, exc: Exception) -> ConvertError:
    return SourceError(f"while converting {unit.key} (from {', '.join(unit.sources[:4])}"
                       f"{', ...' if len(unit.sources) > 4 else ''}): {exc}. The conversion stopped and left no "
                       "complete output.")


class _Pending:
    """A unit whose pieces are under way: their results, and how many are still out."""

    def __init__(self, pieces: int):
        self.results: list = [None] * pieces
        self.left = pieces


def run_units(src: Source, units: list[Unit], writer: ShardWriter, stager: Stager, *, workers: int,
              device: torch.device, unit_done: Callable[[int, Unit], None],
              tick: Callable[[int], None]) -> None:
    """Run every piece of ``units`` on ``workers`` threads; ``unit_done(i, unit)`` follows the last piece of unit
    ``i`` (on the thread that ran it). Raises the first failure in plan order, once no piece is running."""
    errors: list[tuple[tuple[int, int], BaseException]] = []
    lock = threading.Lock()
    slots = threading.Semaphore(max(1, workers) * 2)
    budget = MemoryBudget(MEMORY_BUDGET)
    pending: dict[int, _Pending] = {}

    def run_piece(i: int, k: int, reserved: int) -> None:
        with stage("piece"):  # what the stages inside leave out: the Python between them, and waits for the GIL
            _run_piece(i, k, reserved)

    def _run_piece(i: int, k: int, reserved: int) -> None:
        unit = units[i]
        try:
            try:
                result = unit.run_piece(src, writer, k, device)
            except ValueError as exc:
                raise unit_error(unit, exc) from None
            if reserved >= TRIM_AFTER or anon_resident() > TRIM_ABOVE:
                with stage("trim"):
                    release_memory()
            ranges = unit.filled(k)
            writer.filled(ranges)
            tick(sum(n for _, _, n in ranges))
            with lock:
                state = pending[i]
                state.results[k] = result
                state.left -= 1
                last = state.left == 0
                if last:
                    del pending[i]
            if last:
                try:
                    unit.finish(state.results)
                except ValueError as exc:
                    raise unit_error(unit, exc) from None
                unit_done(i, unit)
        except BaseException as exc:  # noqa: BLE001 - collected, re-raised in plan order
            errors.append(((i, k), exc))
            stager.fail(exc)
        finally:
            budget.release(reserved)
            slots.release()

    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="convert")
    try:
        for i, unit in enumerate(units):
            if errors:
                break
            try:
                with stage("wait:source"):
                    stager.wait(i)
            except BaseException:
                if errors:  # a piece failed; report that failure (below), in plan order
                    break
                raise
            with lock:
                pending[i] = _Pending(unit.pieces())
            for k in range(unit.pieces()):
                if errors:
                    break
                with stage("wait:slot"):
                    slots.acquire()
                with stage("wait:memory"):
                    reserved = budget.acquire(piece_bytes(unit, src))
                pool.submit(run_piece, i, k, reserved)
        with stage("wait:units"):
            pool.shutdown(wait=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
