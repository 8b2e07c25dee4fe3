"""Worker processes that compile kernels for :func:`cute_host.start_compile_all`.

One interpreter (``python -m nvfp4_megamoe.kernels.compile_workers``) imports what a compile needs (torch, CuTeDSL,
this package's kernels) once, then forks one worker per job channel: the workers share those imports instead of
each importing them again, which 16 processes at once took up to 6.3 s to do on the H200 machine's host (one
interpreter alone: about 3 s). :class:`WorkerPool` starts it; ``load_model`` starts one as it begins, so that the
imports run while it reads the checkpoint, and closes it unused when every kernel is in the disk cache.

Not ``multiprocessing``: its spawned workers first re-run the user's main script (``spawn`` and ``forkserver``
both do), so a script without an ``if __name__ == "__main__":`` guard that loads a model would, on a cold kernel
cache, load it again in every worker, each of which then fails to start workers of its own and compiles every
kernel itself (seen on the H200 machine: 16 processes compiling the same 79 kernels). These workers import only
this package. The user's process is never forked (it may hold a CUDA context); the interpreter that forks has
none (a worker describes CUDA operands with CuTe's fake tensors).

Jobs are handed out one at a time, longest first, to whichever worker is free, so a long compile is not queued
behind others; each is ``(op, operand specs, cache location)``, pickled over the worker's job pipe, and the worker
answers on its answer pipe with the seconds it took or why it failed (what the kernels print goes to stderr).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import NamedTuple


class Compiled(NamedTuple):
    """One job's outcome: the op's class name, the worker's pid, seconds compiling, the error (None: stored), the
    seconds the worker took to start (its imports) and when the answer came, in seconds after the pool started."""
    name: str
    worker: int
    seconds: float
    error: str | None
    startup_s: float = 0.0
    finished_s: float = 0.0


def _worker_env() -> dict[str, str]:
    # the parent's import path, as multiprocessing hands it to spawned workers: the package resolves the same way
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)   # "": this process's folder
    return env


def worker_count(processes: int | None) -> int:
    """Compiling workers to start: ``processes``, by default one per CPU core."""
    return max(1, processes or os.cpu_count() or 1)


class WorkerPool:
    """``processes`` compiling workers (:func:`worker_count`) forked by one interpreter started now (module
    docstring); they start compiling when :func:`run_jobs` hands them jobs. :meth:`discard` ends a pool that is not
    needed."""

    def __init__(self, processes: int | None = None):
        self.started = time.perf_counter()
        self.channels: list[tuple[Connection, Connection]] = []   # (jobs to a worker, its answers)
        child_fds = []
        for _ in range(worker_count(processes)):
            job_r, job_w = os.pipe()
            answer_r, answer_w = os.pipe()
            child_fds += [job_r, answer_w]
            self.channels.append((Connection(job_w, readable=False), Connection(answer_r, writable=False)))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, ",".join(map(str, child_fds))], pass_fds=child_fds,
                stdin=subprocess.DEVNULL, env=_worker_env())
        finally:
            for fd in child_fds:
                os.close(fd)

    def close(self, wait_s: float = 60) -> None:
        """Close every job channel (a worker exits after its job), wait for the workers (up to ``wait_s``)."""
        for jobs, answers in self.channels:
            for c in (jobs, answers):
                if not c.closed:
                    c.close()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def discard(self) -> None:
        """End a pool that is given no job (killed: it may still be importing)."""
        self.process.kill()
        self.close()


def run_jobs(jobs: list[tuple], pool: WorkerPool, stop: threading.Event | None = None) -> list[Compiled]:
    """Compile ``jobs`` (in the order given: put the longest first) in the pool's workers, then close it; each worker
    stores its kernels in the disk cache. Returns one :class:`Compiled` per job; a worker that dies fails its job.
    Once ``stop`` is set no job is handed out (those not started are not in the result)."""
    done: list[Compiled] = []
    queue = list(jobs)
    busy: dict[Connection, tuple] = {}
    startup: dict[Connection, float] = {}

    def hand_out(to: Connection, answers: Connection) -> None:
        if stop is not None and stop.is_set():
            queue.clear()
        if queue:
            job = queue.pop(0)
            try:
                to.send(job)
            except OSError:  # the worker is gone (killed, say): its job fails, this process compiles it
                done.append(Compiled(type(job[0]).__name__, 0, 0.0, "the worker process ended", 0.0,
                                     time.perf_counter() - pool.started))
                to.close()
                return
            busy[answers] = (job, to)
        else:
            to.close()  # end of input: the worker exits

    try:
        for to, answers in pool.channels:
            hand_out(to, answers)
        while busy:
            for answers in wait(list(busy)):
                job, to = busy.pop(answers)
                now = time.perf_counter() - pool.started
                try:
                    pid, seconds, error = answers.recv()
                except (EOFError, OSError):
                    done.append(Compiled(type(job[0]).__name__, 0, 0.0, "the worker process ended", 0.0, now))
                    to.close()
                    continue
                if answers not in startup:  # a worker's first answer: it spent the time before the job starting
                    startup[answers] = now - seconds
                done.append(Compiled(type(job[0]).__name__, pid, seconds, error, startup[answers], now))
                hand_out(to, answers)
    finally:
        pool.close()
    for job in queue:  # every worker ended early
        done.append(Compiled(type(job[0]).__name__, 0, 0.0, "no worker process left"))
    return done


def _serve(jobs: Connection, answers: Connection) -> None:
    """A worker: compile each job read from ``jobs`` until it closes, answer each on ``answers``."""
    from nvfp4_megamoe.kernels import cute_host

    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        except Exception as exc:  # noqa: BLE001 - a job this process cannot unpickle: the parent compiles it
            answers.send((os.getpid(), 0.0, f"{type(exc).__name__}: {exc}"))
            continue
        t0 = time.perf_counter()
        try:
            cute_host._compile_share([job])
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which compiles the job itself
            error = f"{type(exc).__name__}: {exc}"
        answers.send((os.getpid(), time.perf_counter() - t0, error))


def _fork_workers(fds: list[int]) -> None:
    """The pool's interpreter: import once, fork one worker per (job, answer) pipe pair, wait for them."""
    os.dup2(2, 1)  # prints of the compiler go to stderr
    import cutlass.cute  # noqa: F401  (what every compile needs, imported once for every worker)

    from nvfp4_megamoe.kernels import cute_host  # noqa: F401

    pairs = list(zip(fds[0::2], fds[1::2]))
    children = []
    for i, (job_r, answer_w) in enumerate(pairs):
        pid = os.fork()
        if pid == 0:
            for j, (r, w) in enumerate(pairs):
                if j != i:
                    os.close(r)
                    os.close(w)
            try:
                _serve(Connection(job_r, writable=False), Connection(answer_w, readable=False))
            finally:
                os._exit(0)
        children.append(pid)
    for r, w in pairs:
        os.close(r)
        os.close(w)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    _fork_workers([int(fd) for fd in sys.argv[1].split(",")])
