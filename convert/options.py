"""What a conversion does (``Options``), apart from the plan so the CLI can read its defaults without torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

DEFAULT_SHARD_SIZE = 5 * 10**9
DENSE_MODES = ("nvfp4", "keep")


@dataclass
class Options:
    """What a conversion does; hashed into the manifest so ``--resume`` can refuse a changed run."""

    dense: str = "nvfp4"
    shard_size: int = DEFAULT_SHARD_SIZE

    def as_dict(self) -> dict:
        return {"dense": self.dense, "shard_size": self.shard_size}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()
