"""sha256 of every source file for the manifest: hashed in the background (or taken from the CLI's early
start, :func:`~.hashing.hash_ahead`), or the Hub's LFS hash checked."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import SourceError
from .hashing import hashed_ahead, sha256_file
from .resume import Journal
from .source import LocalSource

if TYPE_CHECKING:
    from .hub import HubSource

    Source = LocalSource | HubSource


class SourceHashes:
    """sha256 of every source file: computed in the background (local), or the Hub's LFS sha256 checked
    against the downloaded bytes. Reused from the journal on resume for unchanged local files."""

    def __init__(self, src: Source, journal: Journal, pool: ThreadPoolExecutor):
        self.src, self.journal, self.pool = src, journal, pool
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()

    def start(self, file: str) -> None:
        with self.lock:
            if file in self.futures:
                return
            known = self.src.known_sha256(file)
            if known is None and file in self.journal.source_sha256 and isinstance(self.src, LocalSource):
                self.futures[file] = _value(self.journal.source_sha256[file])
                return
            path = self.src.file_path(file)
            self.futures[file] = self.pool.submit(self._hash, file, path, known)

    def _hash(self, file: str, path: Path, known: str | None) -> str:
        sha = hashed_ahead(path) or sha256_file(path)
        if known is not None and sha != known:
            raise SourceError(f"{self.src.description}/{file}: the downloaded file's sha256 is {sha}, but the Hub "
                              f"published {known}; the download is corrupt. Nothing was finished; run again "
                              "(with --resume) to download it again.")
        self.journal.add_source_hash(file, sha)
        return sha

    def wait(self, file: str) -> None:
        f = self.futures.get(file)
        if f is not None:
            f.result()

    def result(self) -> dict:
        out = {}
        for file in self.src.files:
            f = self.futures.get(file)
            sha = f.result() if f is not None else self.src.known_sha256(file) or self.journal.source_sha256.get(file)
            if sha is None:  # a local file no remaining unit needed and no journal entry: hash it now
                sha = hashed_ahead(self.src.file_path(file)) or sha256_file(self.src.file_path(file))
            out[file] = {"size": self.src.file_size(file), "sha256": sha}
        return out


def _value(v) -> Future:
    f: Future = Future()
    f.set_result(v)
    return f
