"""Worker processes that compile kernels for :func:`cute_host.compile_all`, started as
``python -m nvfp4_megamoe.kernels.compile_workers``.

Not ``multiprocessing``: its spawned workers first re-run the user's main script (``spawn`` and ``forkserver``
both do), so a script without an ``if __name__ == "__main__":`` guard that loads a model would, on a cold kernel
cache, load it again in every worker, each of which then fails to start workers of its own and compiles every
kernel itself (seen on the H200 machine: 16 processes compiling the same 79 kernels). These workers import only
this package. Forked workers are no option either: the parent may hold a CUDA context.

Jobs are handed out one at a time, longest first, to whichever worker is free, so a long compile is not queued
behind others; each is ``(op, operand specs, cache location)``, pickled over the worker's stdin, and the worker
answers on its stdout with the seconds it took or why it failed (what the kernels print goes to stderr).
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
    seconds the worker took to start (its imports) and when the answer came, in seconds after the workers started."""
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


def run_jobs(jobs: list[tuple], processes: int, stop: threading.Event | None = None) -> list[Compiled]:
    """Compile ``jobs`` (in the order given: put the longest first) in ``processes`` worker processes; each stores
    its kernels in the disk cache. Returns one :class:`Compiled` per job; a worker that dies fails its job. Once
    ``stop`` is set no job is handed out (those not started are not in the result)."""
    procs, done = [], []
    queue = list(jobs)
    t0 = time.perf_counter()
    for _ in range(min(processes, len(jobs))):
        p = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=_worker_env())
        procs.append((p, Connection(os.dup(p.stdin.fileno())), Connection(os.dup(p.stdout.fileno()))))
        p.stdin.close()
        p.stdout.close()
    busy: dict[Connection, tuple] = {}
    startup: dict[Connection, float] = {}

    def hand_out(to: Connection, answers: Connection) -> None:
        if stop is not None and stop.is_set():
            queue.clear()
        if queue:
            job = queue.pop(0)
            to.send(job)
            busy[answers] = (job, to)
        else:
            to.close()  # end of input: the worker exits

    try:
        for _, to, answers in procs:
            hand_out(to, answers)
        while busy:
            for answers in wait(list(busy)):
                job, to = busy.pop(answers)
                try:
                    pid, seconds, error = answers.recv()
                except (EOFError, OSError):
                    done.append(Compiled(type(job[0]).__name__, 0, 0.0, "the worker process ended", 0.0,
                                         time.perf_counter() - t0))
                    to.close()
                    continue
                now = time.perf_counter() - t0
                if answers not in startup:  # a worker's first answer: it spent the time before the job starting
                    startup[answers] = now - seconds
                done.append(Compiled(type(job[0]).__name__, pid, seconds, error, startup[answers], now))
                hand_out(to, answers)
    finally:
        for p, to, answers in procs:
            for c in (to, answers):
                if not c.closed:
                    c.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    for job in queue:  # every worker ended early
        done.append(Compiled(type(job[0]).__name__, 0, 0.0, "no worker process left"))
    return done


def _serve() -> None:
    """A worker: compile each job read from stdin until it closes, answer each on stdout."""
    jobs, answers = Connection(os.dup(0)), Connection(os.dup(1))
    os.dup2(2, 1)  # prints of the compiler go to stderr, never into the answers
    from nvfp4_megamoe.kernels import cute_host

    import cutlass.cute  # noqa: F401  (what every compile needs: imported before the first job, counted as start-up)

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


if __name__ == "__main__":
    _serve()
