"""A checkpoint on the Hugging Face Hub as a conversion source, through ``huggingface_hub``.

The revision asked for (branch, tag or commit) is resolved once, with
``HfApi.model_info(..., files_metadata=True)``, to a 40-hex commit; every later request is
pinned to that commit, so a branch that moves during a long conversion cannot mix two
checkpoints. ``model_info`` also gives every file's size and (for LFS files) sha256: those go
into the manifest, and each downloaded shard is checked against them.

The plan needs only ``config.json``, the index and the shard headers:
``HfApi.parse_safetensors_file_metadata`` reads each header with a ranged GET, so
``--dry-run`` downloads no shard. Shards are fetched with ``hf_hub_download`` (pinned revision)
when the conversion needs them, validated again locally (the full header and file length) and
compared with the header the plan was made from.

Where shards go: by default the Hugging Face cache (``HF_HUB_CACHE``; shared with other tools,
and kept). With ``keep_source=False`` they go to a staging folder the converter owns (inside
the output folder) and each is deleted as soon as the last unit reading it has finished, so
the disk holds only a few source shards at a time.

Environment: ``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are honoured as
``huggingface_hub`` reads them. Offline, the revision must already be in the cache (a
branch name through ``refs/``, or a commit); sizes are the cached files' and sha256 the LFS
blob names, checked by hashing like local files.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import SourceError
from .safetensors_header import MAX_HEADER_BYTES, Header, header_from_object, read_header
from .source import INDEX_FILE, SINGLE_FILE, FileReader, locate_tensors, read_json, weight_map_from_index

COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
HEADER_THREADS = 8


def _quiet_tqdm():
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _named(repo_id: str, revision: str | None) -> str:
    """``owner/name``, with ``@revision`` only when there is one to name (asked for, or resolved to a commit)."""
    return f"{repo_id}@{revision}" if revision else repo_id


# Said where the Hub does not know the repository or cannot be reached: the user may have meant a local folder.
NOT_LOCAL = "No local file or folder of this name exists here, so it was read as a Hub repo id."


def _hub_error(exc: Exception, repo_id: str, revision: str | None, what: str) -> SourceError:
    """A one-paragraph SourceError for a huggingface_hub failure; ``revision``: the one asked for or resolved (None
    when the user gave none and none is resolved yet: the message then names no revision)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{_named(repo_id, revision)} on {constants.ENDPOINT}"
    if isinstance(exc, GatedRepoError):
        return SourceError(f"{where}: the repository is gated; accept its terms on the Hub and set HF_TOKEN ({what}).")
    if isinstance(exc, RepositoryNotFoundError):
        return SourceError(f"{where}: no such model repository (or it is private: set HF_TOKEN) ({what}). {NOT_LOCAL}")
    if isinstance(exc, RevisionNotFoundError):
        return SourceError(f"{where}: no such revision (branch, tag or commit) ({what}).")
    if isinstance(exc, RemoteEntryNotFoundError):
        return SourceError(f"{where}: {what}: the file does not exist at this revision.")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return SourceError(f"{where}: {what}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set "
                           "(or the Hub cannot be reached). Download it first, or unset HF_HUB_OFFLINE.")
    return SourceError(f"{where}: {what} failed: {type(exc).__name__}: {exc}. Check the network, HF_ENDPOINT and HF_TOKEN; "
                       f"a Hub checkpoint already in the cache can be used with HF_HUB_OFFLINE=1. {NOT_LOCAL}")


class HubSource(FileReader):
    """A model repository on the Hub (or its local cache when offline), pinned to one commit."""

    kind = "hub"

    def __init__(self, repo_id: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                 staging_dir: str | os.PathLike | None = None, progress: bool = False):
        from huggingface_hub import constants

        super().__init__()
        self.repo_id = repo_id
        self.ref = revision  # as asked for (None: the default branch), named in messages only when given
        self.revision = revision or "main"
        self.cache_dir = str(cache_dir) if cache_dir is not None else None
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        self.endpoint = constants.ENDPOINT
        self.offline = bool(constants.HF_HUB_OFFLINE)
        self._tqdm = None if progress else _quiet_tqdm()
        self._paths: dict[str, Path] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.sizes: dict[str, int] = {}
        self.lfs_sha256: dict[str, str | None] = {}
        if self.offline:
            self._init_offline()
        else:
            self._init_online()

    description = property(lambda self: f"{self.repo_id}@{self.commit}")

    # ------------------------------------------------------------------ setup

    def _download(self, file: str, *, staged: bool = False, local_only: bool = False,
                  revision: str | None = None) -> Path:
        from huggingface_hub import hf_hub_download

        revision = revision or getattr(self, "commit", None) or self.revision
        named = self.ref if revision == self.revision else revision
        try:
            if staged and self.staging_dir is not None:
                path = hf_hub_download(self.repo_id, file, revision=revision, local_dir=self.staging_dir,
                                       local_files_only=local_only, tqdm_class=self._tqdm)
            else:
                path = hf_hub_download(self.repo_id, file, revision=revision, cache_dir=self.cache_dir,
                                       local_files_only=local_only, tqdm_class=self._tqdm)
        except Exception as exc:  # huggingface_hub raises many kinds; each becomes one clear message
            raise _hub_error(exc, self.repo_id, named, f"downloading {file}") from None
        return Path(path)

    def _init_online(self) -> None:
        from huggingface_hub import HfApi

        api = HfApi()
        try:
            info = api.model_info(self.repo_id, revision=self.revision, files_metadata=True)
        except Exception as exc:
            raise _hub_error(exc, self.repo_id, self.ref, "reading the model info") from None
        if not isinstance(info.sha, str) or not COMMIT.match(info.sha):
            raise SourceError(f"{_named(self.repo_id, self.ref)}: the Hub did not resolve the revision to a commit "
                              f"(got {info.sha!r})")
        self.commit = info.sha
        siblings = {s.rfilename: s for s in (info.siblings or [])}
        for name, s in siblings.items():
            self.sizes[name] = s.lfs.size if s.lfs is not None else s.size
            self.lfs_sha256[name] = s.lfs.sha256 if s.lfs is not None else None
        self.repo_files = sorted(siblings)
        if "config.json" not in siblings:
            raise SourceError(f"{self.description}: no config.json; a DeepSeek-V4 checkpoint repository has one")
        # config.json by the revision asked for, so the cache learns ``refs/<revision>`` (offline runs
        # resolve the same name later); it must land in the commit model_info resolved.
        config_path = self._download("config.json", revision=self.revision)
        if config_path.parent.name != self.commit:
            raise SourceError(f"{_named(self.repo_id, self.revision)} moved from {self.commit} to {config_path.parent.name} "
                              "while the conversion started; run again (or pass --revision COMMIT).")
        self.config = read_json(config_path, "a DeepSeek-V4 config.json is a JSON object")
        where = f"{self.description}/{INDEX_FILE}"
        if INDEX_FILE in siblings:
            weight_map = weight_map_from_index(read_json(self._download(INDEX_FILE), "the safetensors index is corrupt"),
                                               where)
            files = sorted(set(weight_map.values()))
        elif SINGLE_FILE in siblings:
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise SourceError(f"{self.description}: neither {INDEX_FILE} nor {SINGLE_FILE}; not a safetensors checkpoint")
        missing = [f for f in files if f not in siblings]
        if missing:
            raise SourceError(f"{where} names shard files that the repository does not have at commit {self.commit}: "
                              f"{', '.join(missing)}. A checkpoint with missing shards would silently lose tensors.")
        self.files = files
        with ThreadPoolExecutor(HEADER_THREADS, thread_name_prefix="hub-header") as pool:
            self.headers = dict(zip(files, pool.map(lambda f: self._remote_header(api, f), files)))
        if weight_map is None:
            weight_map = {n: SINGLE_FILE for n in self.headers[SINGLE_FILE].tensors}
        self.tensors = locate_tensors(weight_map, self.headers, where)

    def _remote_header(self, api, file: str) -> Header:
        """A shard's header through a ranged read, validated against the file size the Hub reports."""
        where = f"{self.description}/{file}"
        try:
            meta = api.parse_safetensors_file_metadata(self.repo_id, file, revision=self.commit)
        except Exception as exc:
            from huggingface_hub.errors import SafetensorsParsingError

            if isinstance(exc, SafetensorsParsingError):
                raise SourceError(f"{where}: the safetensors header is corrupt ({exc}); the shard cannot be converted. "
                                  "Report it to the repository owner, or use another revision.") from None
            raise _hub_error(exc, self.repo_id, self.commit, f"reading the header of {file}") from None
        obj = {"__metadata__": meta.metadata}
        for name, t in meta.tensors.items():
            obj[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
        size = self.sizes.get(file)
        if size is None:
            raise SourceError(f"{where}: the Hub did not report the file's size")
        # The decoded header does not carry its own length: the data ends at the end of the file.
        end = max((t.data_offsets[1] for t in meta.tensors.values()), default=0)
        data_start = size - end
        if data_start < 8 or data_start - 8 > MAX_HEADER_BYTES:
            raise SourceError(f"{where}: the header's tensors need {end} data bytes but the file has {size} bytes in all; "
                              "the shard is truncated or its header is corrupt.")
        return header_from_object(obj, where, data_start, size)

    def _init_offline(self) -> None:
        config_path = self._download("config.json", local_only=True)
        commit = config_path.parent.name
        if not COMMIT.match(commit):
            raise SourceError(f"{_named(self.repo_id, self.ref)}: the cached snapshot {config_path.parent} is not named by "
                              "a commit; cannot pin the revision offline")
        self.commit = commit
        self.config = read_json(config_path, "a DeepSeek-V4 config.json is a JSON object")
        index_path = config_path.parent / INDEX_FILE
        where = f"{self.description}/{INDEX_FILE}"
        if index_path.exists():
            weight_map = weight_map_from_index(read_json(self._download(INDEX_FILE, local_only=True),
                                                         "the safetensors index is corrupt"), where)
        else:
            weight_map = None
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self.headers = {}
        for f in files:
            path = self._download(f, local_only=True)
            self._paths[f] = path
            self.headers[f] = read_header(path)
            self.sizes[f] = self.headers[f].file_size
            blob = os.path.basename(os.path.realpath(path))
            self.lfs_sha256[f] = blob if SHA256.match(blob) else None
        self.files = files
        self.repo_files = sorted(p.name for p in config_path.parent.iterdir())
        if weight_map is None:
            weight_map = {n: SINGLE_FILE for n in self.headers[SINGLE_FILE].tensors}
        self.tensors = locate_tensors(weight_map, self.headers, where)

    # ------------------------------------------------------------------ surface used by the converter

    def record(self) -> dict:
        # docs/format.md: "revision" is the resolved 40-hex commit; "ref" is what was asked for.
        return {"kind": "hub", "repo_id": self.repo_id, "revision": self.commit, "ref": self.revision,
                "endpoint": self.endpoint}

    def file_size(self, file: str) -> int:
        return self.sizes[file]

    def known_sha256(self, file: str) -> str | None:
        return self.lfs_sha256.get(file)

    def stamp(self, file: str) -> dict:
        return {"size": self.sizes[file], "sha256": self.lfs_sha256.get(file)}

    def file_path(self, file: str) -> Path:
        path = self._paths.get(file)
        if path is None:
            raise AssertionError(f"{file} was read before it was fetched")
        return path

    def _lock(self, file: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(file, threading.Lock())

    def fetch(self, file: str) -> None:
        """Download one shard (pinned commit), then check it against the header the plan was made from."""
        with self._lock(file):
            if file in self._paths:
                return
            path = self._download(file, staged=True)
            header = read_header(path)
            planned = self.headers[file]
            if header.file_size != self.sizes[file] or header.tensors != planned.tensors:
                raise SourceError(f"{self.description}/{file}: the downloaded file ({header.file_size} bytes) does not "
                                  f"match what the Hub reported ({self.sizes[file]} bytes, and the header read before "
                                  "the download); the repository changed or the download is corrupt. Run again.")
            self._paths[file] = path

    @property
    def staged(self) -> bool:
        return self.staging_dir is not None and not self.offline

    def release(self, file: str) -> None:
        """Delete a staged shard once no unit needs it (only shards in the converter's own staging folder)."""
        if not self.staged:
            return
        with self._lock(file):
            path = self._paths.pop(file, None)
            self._close_file(file)
            if path is not None:
                path.unlink(missing_ok=True)

    def extra_files(self) -> list[str]:
        """Top-level non-tensor files of the repository (config, tokenizer, generation config, ...)."""
        return [f for f in self.repo_files if "/" not in f and not f.endswith(".safetensors") and f != INDEX_FILE
                and not f.startswith(".")]

    def extra_file_path(self, name: str) -> Path:
        return self._download(name, local_only=self.offline)
