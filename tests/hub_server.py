"""A small Hugging Face Hub protocol server for tests (127.0.0.1, a thread), serving folders as model repos.

It implements what the installed ``huggingface_hub`` client uses to read a model repository
(read from its source: ``HfApi.model_info``, ``hf_hub_download``, ``parse_safetensors_file_metadata``):

* ``GET /api/models/{repo}[/revision/{rev}]`` -> ``id``, ``sha`` (the commit) and ``siblings`` with
  ``size``, ``blobId`` and, for ``*.safetensors`` (stored "in LFS"), ``lfs: {sha256, size, pointerSize}``;
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit`` and ``ETag`` (a git-style sha1);
  for LFS files, as the Hub does, a 302 to a CDN URL on another origin (``/cdn/{repo}/{sha256}/{path}``) carrying
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``; file bytes (resolve of a regular file, or the
  CDN URL) with ``Content-Length`` and ``Range: bytes=a-b`` (206 + ``Content-Range``);
* errors as the Hub sends them: 404 + ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound``,
  401 for a repo that needs a token the request did not carry.

Revisions: ``main`` and the repo's commit (40 hex). Every request is logged (method, path, range)
so tests can check what was (not) downloaded. ``lfs_sha256_override`` publishes a wrong sha256
for a file (a corrupt download from the client's point of view).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    folder: Path
    commit: str
    token: str | None = None  # required bearer token (private repo), or None
    lfs_sha256_override: dict[str, str] = field(default_factory=dict)
    _sha256: dict[str, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())

    def sha256(self, name: str) -> str:
        if name in self.lfs_sha256_override:
            return self.lfs_sha256_override[name]
        if name not in self._sha256:
            h = hashlib.sha256()
            with open(self.folder / name, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            self._sha256[name] = h.hexdigest()
        return self._sha256[name]

    def git_oid(self, name: str) -> str:
        path = self.folder / name
        if name.endswith(".safetensors"):  # an LFS pointer's oid; content-independent here
            return hashlib.sha1(f"lfs {name} {path.stat().st_size}".encode()).hexdigest()
        data = path.read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    """``with HubServer() as hub: hub.add("org/model", folder); os.environ["HF_ENDPOINT"] = hub.endpoint``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._handle(self, head=True)

            def do_GET(self) -> None:
                server._handle(self, head=False)

        # Two origins, as on the Hub: the API/resolve endpoint, and a "CDN" that LFS resolves redirect to.
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
        for srv in self.servers:
            srv.daemon_threads = True
        self.endpoint, self.cdn = (f"http://127.0.0.1:{srv.server_address[1]}" for srv in self.servers)
        self.threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in self.servers]

    def add(self, repo_id: str, folder: Path, *, commit: str | None = None, token: str | None = None) -> Repo:
        commit = commit or hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        repo = self.repos[repo_id] = Repo(Path(folder), commit, token)
        return repo

    def __enter__(self) -> "HubServer":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for srv in self.servers:
            srv.shutdown()
            srv.server_close()

    def downloads(self, suffix: str = ".safetensors") -> list[tuple[str, str | None]]:
        """(path, range) of every GET of file bytes (CDN or resolve URL) for files ending with ``suffix``."""
        with self.lock:
            return [(p, r) for m, p, r in self.log if m == "GET" and p.startswith("/cdn/") and p.endswith(suffix)
                    or m == "GET" and "/resolve/" in p and p.endswith(suffix) and not suffix.endswith(".safetensors")]

    # ------------------------------------------------------------------ request handling

    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict, body: bytes = b"", head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, str(v))
        if "Content-Length" not in headers:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str | None, message: str, head: bool, extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, status, headers, json.dumps({"error": message}).encode(), head)

    def _repo(self, h, repo_id: str, head: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", f"Repository {repo_id} not found", head)
            return None
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header", head)
            return None
        return repo

    def _commit(self, h, repo: Repo, rev: str, head: bool) -> str | None:
        if rev in ("main", repo.commit):
            return repo.commit
        self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        return None

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self.lock:
            self.log.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m:
            return self._model_info(h, m.group(1), m.group(2) or "main", head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, m.group(1), m.group(2), m.group(3), head)
        m = re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{64})/(.+)", path)
        if m:
            repo = self.repos.get(m.group(1))
            if repo is not None and (repo.folder / m.group(3)).is_file():
                return self._bytes(h, repo.folder / m.group(3), {"ETag": f'"{m.group(2)}"'}, head)
        self._error(h, 404, None, f"no route for {path}", head)

    def _model_info(self, h, repo_id: str, rev: str, head: bool) -> None:
        repo = self._repo(h, repo_id, head)
        if repo is None or (commit := self._commit(h, repo, rev, head)) is None:
            return
        siblings = []
        for name in repo.files():
            size = (repo.folder / name).stat().st_size
            s = {"rfilename": name, "size": size, "blobId": repo.git_oid(name)}
            if name.endswith(".safetensors"):
                s["lfs"] = {"sha256": repo.sha256(name), "size": size, "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.token is not None,
                           "siblings": siblings}).encode()
        self._send(h, 200, {"Content-Type": "application/json"}, body, head)

    def _resolve(self, h, repo_id: str, rev: str, name: str, head: bool) -> None:
        repo = self._repo(h, repo_id, head)
        if repo is None or (commit := self._commit(h, repo, rev, head)) is None:
            return
        path = repo.folder / name
        if ".." in Path(name).parts or not path.is_file():
            self._error(h, 404, "EntryNotFound", f"{name} does not exist on {rev}", head,
                        {"X-Repo-Commit": commit})
            return
        size = path.stat().st_size
        if name.endswith(".safetensors"):  # LFS: redirect to the CDN, metadata on the redirect
            sha = repo.sha256(name)
            self._send(h, 302, {"X-Repo-Commit": commit, "ETag": f'"{repo.git_oid(name)}"',
                                "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": size,
                                "Location": f"{self.cdn}/cdn/{repo_id}/{sha}/{name}"}, b"", head)
            return
        self._bytes(h, path, {"X-Repo-Commit": commit, "ETag": f'"{repo.git_oid(name)}"'}, head)

    def _bytes(self, h, path: Path, headers: dict, head: bool) -> None:
        size = path.stat().st_size
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start, end, status = 0, size - 1, 200
        rng = h.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                self._error(h, 416, None, f"bad range {rng}", head)
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                start, end = max(0, size - int(m.group(2))), size - 1
            if start >= size:
                self._send(h, 416, {"Content-Range": f"bytes */{size}"}, b"", head)
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = end - start + 1
        self._send(h, status, headers, b"", head=True)
        if head:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            try:
                while left:
                    block = f.read(min(left, 1 << 20))
                    if not block:
                        break
                    h.wfile.write(block)
                    left -= len(block)
            except (BrokenPipeError, ConnectionResetError):
                pass
