"""What a checkpoint's tensor values may be: the screen every tensor read from a source (and every tensor
``verify`` reads from a conversion) goes through.

Kept apart from ``source.py`` (where tensors live and how their bytes are read), which needs no torch until a
tensor is read: the command line answers questions about folders and headers before torch is imported.
"""

from __future__ import annotations

import math

import torch

from .errors import SourceError, shown

# 8-bit float formats whose bytes of magnitude (byte & 0x7F) from this value up are NaN or Inf
# (E4M3fn: S.1111.111; E5M2: S.11111.xx). In E8M0 only the byte 0xFF is (NaN).
_NAN_MAGNITUDE = {"F8_E4M3": 0x7F, "F8_E5M2": 0x7C}
FLOAT32_MAX = torch.finfo(torch.float32).max
HUGE = 2.0**64  # a float value beyond this has a square that overflows float32
_FLOATS = ("F64", "F32", "F16", "BF16")


def _bad_values(t: torch.Tensor, dtype: str) -> torch.Tensor | None:
    """Boolean mask of values a checkpoint must not hold, or None when it holds none.

    8-bit formats are screened first by two max reductions, which need no temporaries and are
    exact: a positive byte of magnitude >= m is a signed byte >= m, a negative one an unsigned
    byte >= m | 0x80. The mask is formed only when something is there to report.
    """
    if dtype == "F8_E8M0":
        b = t.view(torch.uint8)
        return b == 0xFF if b.numel() and int(b.max()) == 0xFF else None
    if dtype in _NAN_MAGNITUDE:
        m, b = _NAN_MAGNITUDE[dtype], t.view(torch.uint8)
        if not b.numel() or (int(b.view(torch.int8).max()) < m and int(b.max()) < m | 0x80):
            return None
        return (b & 0x7F) >= m
    if dtype in _FLOATS:
        return ~torch.isfinite(t)
    return None


def largest_scale_byte(element_max: float) -> int:
    """The largest E8M0 byte ``b`` with ``element_max * 2**(b - 127)`` finite in float32."""
    return math.floor(math.log2(FLOAT32_MAX / element_max)) + 127


def _overflowing_scales(t: torch.Tensor, dtype: str, element_max: float) -> tuple[torch.Tensor, str] | None:
    """Mask of E8M0 block scales whose product with an element of magnitude ``element_max`` overflows float32
    (with what was found), or None when there is none. Float scales need no rule of their own: one whose product
    could overflow (above 3.4e38 / 448) is far beyond :data:`HUGE`, refused for every float."""
    if dtype not in ("F8_E8M0", "U8"):
        return None
    b, top = t.view(torch.uint8), largest_scale_byte(element_max)
    if not b.numel() or int(b.max()) <= top:
        return None
    return b > top, f"E8M0 scale bytes above 0x{top:02X} (2**{top - 127})"


def _refuse(name: str, file: str, dtype: str, shape: tuple[int, ...] | list[int], count: int, first: int,
            what: str, expected: str) -> SourceError:
    return SourceError(f"{shown(file)}: tensor {shown(name)} ({dtype} {list(shape)}) holds {count} {what}, the first "
                       f"at flat index {first}; expected {expected}. The shard is corrupt (download or copy it again); "
                       "the conversion stopped and left no complete output.", path=file, tensor=name)


class ValueScreen:
    """What a tensor's values must satisfy, checked on the whole tensor or chunk by chunk.

    Always: no NaN/Inf float, no float beyond +-2**64 (its square overflows float32, in which the runtime
    computes), no NaN 8-bit float code, no E8M0 0xFF. ``element_max``: the tensor holds
    block scales of elements up to that magnitude, and their products must be finite in float32 (an
    E8M0 byte 0xFE times any E2M1 or E4M3 element overflows). ``index_limit``: the tensor holds indices,
    which must lie in ``[0, index_limit)`` (a hash layer's ``tid2eid`` names experts).
    """

    def __init__(self, name: str, file: str, dtype: str, shape: tuple[int, ...], *,
                 element_max: float | None = None, index_limit: int | None = None):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, shape
        self.element_max, self.index_limit = element_max, index_limit
        self.found: dict[str, list] = {}  # what -> [count, first flat index, what was expected]

    def _note(self, mask: torch.Tensor, base: int, what: str, expected: str) -> None:
        flat = mask.reshape(-1)
        count = int(flat.sum())
        if count:
            entry = self.found.setdefault(what, [0, base + int(flat.nonzero()[0]), expected])
            entry[0] += count

    def update(self, t: torch.Tensor, base: int = 0) -> None:
        """Check ``t``, the elements from flat index ``base`` on."""
        bad = _bad_values(t, self.dtype)
        if bad is not None:
            what = {"F8_E8M0": "E8M0 scale bytes 0xFF (NaN)", "F8_E4M3": "E4M3 NaN bytes (0x7F/0xFF)",
                    "F8_E5M2": "E5M2 Inf/NaN bytes"}.get(self.dtype, "NaN/Inf values")
            self._note(bad, base, what, "finite values")
        if self.dtype in _FLOATS and t.numel() and float(t.abs().amax()) > HUGE:  # a NaN is reported above
            self._note(t.abs() > HUGE, base, "values beyond +-2**64",
                       "magnitudes whose squares are finite in float32 (the runtime squares and sums values in norms "
                       "and dot products)")
        if self.element_max is not None:
            over = _overflowing_scales(t, self.dtype, self.element_max)
            if over is not None:
                self._note(over[0], base, over[1], f"scales whose products with elements up to {self.element_max:g} "
                           "stay finite in float32")
        if self.index_limit is not None and t.numel() and not t.dtype.is_floating_point:
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= self.index_limit:
                self._note((t < 0) | (t >= self.index_limit), base, f"indices outside [0, {self.index_limit})",
                           f"expert indices below n_routed_experts = {self.index_limit}")

    def merge(self, later: "ValueScreen") -> None:
        """Add what the screen of a later piece of the same tensor found."""
        for what, (count, first, expected) in later.found.items():
            self.found.setdefault(what, [0, first, expected])[0] += count

    def problems(self) -> list[str]:
        """What was found, one sentence per kind of bad value (empty when the values hold)."""
        return [f"holds {count} {what}, the first at flat index {first}; expected {expected}"
                for what, (count, first, expected) in self.found.items()]

    def finish(self) -> None:
        """Raise the first problem found, as a :class:`SourceError` naming the tensor and its file."""
        for what, (count, first, expected) in self.found.items():
            raise _refuse(self.name, self.file, self.dtype, self.shape, count, first, what, expected)


def check_values(name: str, file: str, dtype: str, t: torch.Tensor, element_max: float | None = None) -> None:
    """Refuse NaN/Inf floats and NaN 8-bit float codes (found while converting), naming the tensor;
    with ``element_max``, also block scales whose products overflow float32 (:class:`ValueScreen`)."""
    screen = ValueScreen(name, file, dtype, tuple(t.shape), element_max=element_max)
    screen.update(t)
    screen.finish()
