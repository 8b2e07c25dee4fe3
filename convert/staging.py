"""Source staging: fetch the shards units need in order of first use, release them after their last use."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .hub import HubSource
    from .source import LocalSource

    Source = LocalSource | HubSource


class Stager:
    """Fetches the source files units need, in order of first use, and releases them after their last use.

    ``needs[i]`` lists the files unit ``i`` (in run order) reads. Downloads run ahead of the
    conversion; when ``ahead`` is set, at most that many fetched files wait beyond the ones the
    earliest unfinished unit needs (so disk use stays at a few shards).
    """

    def __init__(self, src: Source, needs: list[list[str]], *, ahead: int | None, threads: int,
                 on_fetched: Callable[[str], None], before_release: Callable[[str], None]):
        self.src, self.needs, self.ahead = src, needs, ahead
        self.on_fetched, self.before_release = on_fetched, before_release
        self.first_use: dict[str, int] = {}
        self.users: dict[str, int] = {}
        for i, files in enumerate(needs):
            for f in files:
                self.first_use.setdefault(f, i)
                self.users[f] = self.users.get(f, 0) + 1
        self.order = sorted(self.first_use, key=lambda f: (self.first_use[f], f))
        self.cond = threading.Condition()
        self.ready: set[str] = set()
        self.resident = 0
        self.next_file = 0
        self.finished = [False] * len(needs)
        self.frontier = 0  # earliest unfinished unit
        self.error: BaseException | None = None
        self.stopped = False
        self.threads = [threading.Thread(target=self._download_loop, name=f"fetch-{k}", daemon=True)
                        for k in range(min(threads, len(self.order)))]
        for t in self.threads:
            t.start()

    def _download_loop(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and self.next_file < len(self.order):
                    f = self.order[self.next_file]
                    if self.ahead is None or self.resident < self.ahead or self.first_use[f] <= self.frontier:
                        break
                    self.cond.wait()
                if self.stopped or self.next_file >= len(self.order):
                    return
                self.next_file += 1
                self.resident += 1
            try:
                self.src.fetch(f)
                self.on_fetched(f)
            except BaseException as exc:  # noqa: BLE001 - handed to the converting thread
                with self.cond:
                    self.error = self.error or exc
                    self.cond.notify_all()
                return
            with self.cond:
                self.ready.add(f)
                self.cond.notify_all()

    def wait(self, i: int) -> None:
        """Block until unit ``i``'s files are all fetched."""
        with self.cond:
            while not all(f in self.ready for f in self.needs[i]):
                if self.error is not None:
                    raise self.error
                self.cond.wait()

    def done(self, i: int) -> None:
        """Unit ``i`` finished: release files no later unit needs."""
        release = []
        with self.cond:
            self.finished[i] = True
            while self.frontier < len(self.finished) and self.finished[self.frontier]:
                self.frontier += 1
            for f in self.needs[i]:
                self.users[f] -= 1
                if self.users[f] == 0:
                    release.append(f)
            self.cond.notify_all()
        for f in release:
            self.before_release(f)
            self.src.release(f)
            with self.cond:
                self.resident -= 1
                self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """A unit failed: wake whoever waits for files (the failure is reported, not a download)."""
        with self.cond:
            self.error = self.error or exc
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for t in self.threads:
            t.join()
