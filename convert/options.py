"""What a conversion does (``Options``), apart from the plan so the CLI can read its defaults without torch."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

# A shard's sha256 is one stream (1.2-1.5 GB/s on one core) that cannot be split, and the last shard's hash is what
# ends a conversion: at 1 GB no shard takes more than about a second to hash behind its last write, and the shards
# under way hash side by side (``hashing.hash_threads``). Also what an interrupted run loses at most (``--resume``
# keeps finished shards). Format 1 takes any shard size.
DEFAULT_SHARD_SIZE = 10**9
DENSE_MODES = ("nvfp4", "keep")
# keep: the dense FP8 linears (attention, shared experts, indexer projections) pass through as released, byte for
# byte; nvfp4 requantises them (a relative weight error of about 0.09-0.10 for about 2 % of the checkpoint's bytes)
DEFAULT_DENSE = "keep"

# sm100: format 1's canonical layout (Blackwell's). sm90: the same, with the routed experts' packed weights in
# Hopper row tiles (``kernels/row_tiles.py``), which the SM90 MoE kernels read 6-12 % faster on an H200.
TARGETS = ("sm100", "sm90")


def default_workers() -> int:
    """The converter's worker threads unless told: one per CPU this process may run on, at most 32."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, cpus))


@dataclass
class Options:
    """What a conversion does; hashed into the manifest so ``--resume`` can refuse a changed run."""

    dense: str = DEFAULT_DENSE
    shard_size: int = DEFAULT_SHARD_SIZE
    target: str = "sm100"

    def as_dict(self) -> dict:
        return {"dense": self.dense, "shard_size": self.shard_size, "target": self.target}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()
