"""The SOURCE a user names: a local checkpoint folder or a Hub repository id, never one taken for the other.

``owner/name`` is read as a Hub repo id only when nothing exists at that path and nothing named ``owner`` exists
here: ``w/src-flsh`` beside a folder ``w`` is a mistyped local path (a missing folder), never a request to the Hub.
Anything else (an absolute path, ``./x``, two or more ``/``, ``..``) is a local path.
"""

from __future__ import annotations

import os
import re

from .errors import SourceError
from .hub import HubSource
from .source import LocalSource

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")

Source = LocalSource | HubSource


def looks_like_repo_id(text: str) -> bool:
    """``owner/name`` where neither the path nor a local ``owner`` exists (see the module docstring)."""
    return (bool(REPO_ID.match(text)) and ".." not in text and not os.path.lexists(text)
            and not os.path.lexists(text.split("/")[0]))


def open_source(source: str | os.PathLike, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                staging_dir: str | os.PathLike | None = None, progress: bool = False) -> Source:
    """A local checkpoint folder, or a Hub repository id (``owner/name``) at ``revision``."""
    text = os.fspath(source)
    if looks_like_repo_id(text):
        return HubSource(text, revision, cache_dir=cache_dir, staging_dir=staging_dir, progress=progress)
    owner = text.split("/")[0]
    if REPO_ID.match(text) and ".." not in text and not os.path.lexists(text):
        raise SourceError(f"{text}: no such folder. {owner!r} exists here, so {text!r} is read as a local path, not as "
                          f"a Hub repo id: check the path (to read the Hub repository {text}, run from a folder that "
                          f"holds no {owner!r}).", path=text)
    if revision is not None:
        raise SourceError(f"{text}: --revision applies to Hub repositories (owner/name), and this is a local path")
    return LocalSource(text)
