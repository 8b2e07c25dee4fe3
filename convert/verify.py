"""``verify_checkpoint``: prove a converted checkpoint is what its manifest says, without running the model.

Three layers of checks, all streaming (one expert in memory at a time, passthrough tensors
compared in 64 MiB chunks, shards hashed in chunks on a helper thread):

1. **Structure** (:mod:`.verify_structure`): manifest, index and shard headers agree both ways;
   every shard's size is its header's end; every shard's sha256 matches the manifest (skipped
   with ``fast``); dtypes and shapes match the plan re-made from the source, or config.json.
2. **Values of the NVFP4 tensors** (always): no NaN/Inf/non-positive alpha, no NaN E4M3 byte
   (0x7F/0xFF) in any ``weight_scale``, every swizzle padding byte zero.
   Every other tensor holds no NaN/Inf float and no NaN 8-bit float code.
3. **Round trip** (against the source given, or the local source path the manifest recorded;
   :mod:`.verify_roundtrip`): the inverse transforms on every converted item compared
   with the source tensors: lossless paths bit-exact (codes and effective scales), lossy paths
   within the documented bounds (docs/format.md, "Verification bounds") and equal to the error
   the manifest recorded; passthrough tensors byte-identical; ModelOpt ``input_scale`` equal.
   When no source can be reached the round trip cannot be done, and that is a failure unless
   ``structure_only`` says the caller does not ask for it.

The result is a :class:`VerifyReport`; ``report.ok`` is true only when every check held.
Names read from the checkpoint are printed escaped (``errors.shown``).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import Counter, defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from nvfp4_megamoe.input_files import folder_problem, read_json_object
from nvfp4_megamoe.kernels.row_tiles import untile_rows
from nvfp4_megamoe.kernels.scales import E4M3_NAN_BYTES
from nvfp4_megamoe.kernels.swizzle import swizzle_padding
from nvfp4_megamoe.runtime.config import ModelConfig
from nvfp4_megamoe.runtime.format import FormatError, has_row_tiles

from .errors import ConvertError, shown
from .options import DEFAULT_SHARD_SIZE, Options
from .plan import Plan, make_plan
from .safetensors_header import DTYPES, TensorInfo, tensor_from_bytes
from .source import LocalSource
from .summary import counted, tensor_kind
from .value_screen import ValueScreen
from .units import FusedMatrices, Passthrough
from .verify_roundtrip import BOUNDS, CHECKS, Item, UnitCheck, bound_violations, manifest_disagreement, scale_cols
from .verify_structure import Layout, check_against_config, check_files, nvfp4_groups
from .hashing import sha256_file

__all__ = ["Failure", "TensorResult", "VerifyReport", "format_report", "verify_checkpoint"]

CHUNK = 64 * 1024 * 1024
DEFAULT_WORKERS = 2
PROBLEMS_PER_TENSOR = 5


@dataclass
class Failure:
    """One check that did not hold: the tensor and/or shard it concerns and what was wrong."""

    tensor: str | None
    shard: str | None
    message: str

    def __str__(self) -> str:
        where = " ".join(shown(x) for x in (self.tensor, f"[{self.shard}]" if self.shard else None) if x)
        return f"{where}: {self.message}" if where else self.message


@dataclass
class TensorResult:
    """Verification of one output tensor.

    ``kind``: ``passthrough`` (byte copy), ``lossless`` (bit-exact NVFP4), ``lossy`` (measured
    error within bounds), ``input_scale`` (ModelOpt activation scales), ``other``.
    ``checked``: ``round trip`` when compared with the source, ``structure`` otherwise.
    ``source_format``: ``mxfp4``, ``nvfp4``, ``ct_nvfp4`` or ``fp8`` for converted matrices (round trip only).
    ``error`` (lossy ``.weight`` tensors): measured rel_fro / max_abs / cosine; ``bound`` the
    documented limits; ``manifest_error`` what the manifest recorded.
    """

    name: str
    shard: str | None
    kind: str
    checked: str = "structure"
    source_format: str | None = None
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    inexact_blocks: int | None = None
    error: dict | None = None
    bound: dict | None = None
    manifest_error: dict | None = None


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`. ``ok`` holds only when there is no failure."""

    out: str
    source: str | None = None
    round_trip: bool = False
    hashed: bool = False
    shards: list[str] = field(default_factory=list)
    tensors: dict[str, TensorResult] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, tensor: str | None, shard: str | None, message: str) -> None:
        self.failures.append(Failure(tensor, shard, message))
        if tensor in self.tensors:
            self.tensors[tensor].ok = False
            self.tensors[tensor].problems.append(message)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["bounds"] = {k: b.as_dict() for k, b in BOUNDS.items()}
        return d

    def write_json(self, path: str | os.PathLike) -> None:
        """Write the full per-tensor report as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, default=str))


class OutputReader:
    """Reads whole tensors or one leading-dimension item of a converted shard with ``os.pread``."""

    def __init__(self, out: Path, lay: Layout):
        self.out = out
        self.info = {t: (name, i) for name, h in lay.headers.items() for t, i in h.tensors.items()}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, shard: str) -> int:
        with self._lock:
            if shard not in self._fds:
                self._fds[shard] = os.open(self.out / shard, os.O_RDONLY)
            return self._fds[shard]

    def read(self, name: str, item: int | None = None) -> torch.Tensor:
        shard, info = self.info[name]
        start, count, shape = info.start, info.nbytes, info.shape
        if item is not None:
            count = info.nbytes // info.shape[0]
            start, shape = start + item * count, info.shape[1:]
        data = os.pread(self.fd(shard), count, start)
        if len(data) != count:
            raise ConvertError(f"{shard}: short read of {name}; the file changed while verifying")
        return tensor_from_bytes(data, TensorInfo(info.dtype, shape, 0, count))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _open_source(source: str | os.PathLike | None, manifest: dict, rep: VerifyReport,
                 structure_only: bool) -> LocalSource | None:
    recorded = manifest.get("source")
    recorded = recorded if isinstance(recorded, dict) else {}
    if structure_only:
        return None
    if source is None:
        path = recorded.get("path") if recorded.get("kind") == "local" else None
        if not isinstance(path, str) or not path or not Path(path).is_dir():
            what = (f"the source the manifest recorded, {shown(path)}, is not a folder here" if path else
                    "the manifest records no local source (a Hub conversion, or the record was removed)")
            rep.fail(None, None, f"the round trip against the source cannot be done: {what}. Give the source folder "
                     "with --source, or pass --structure-only to check structure, hashes and values without it.")
            return None
        source = path
    try:
        src = LocalSource(source)
    except ConvertError as exc:
        rep.fail(None, None, f"source {source}: {exc}")
        return None
    rep.source = str(source)
    files = recorded.get("files") if isinstance(recorded.get("files"), dict) else {}
    for f in sorted(set(files) | set(src.files)):
        if f not in src.files:
            rep.fail(None, f, f"the conversion read this source shard but {source} has no such file in its index")
        elif f not in files:
            rep.fail(None, f, f"source shard of {source} that the manifest does not record: not the source converted")
        elif not isinstance(files[f], dict) or os.path.getsize(src.file_path(f)) != files[f].get("size"):
            rep.fail(None, f, f"source shard is {os.path.getsize(src.file_path(f))} bytes, the manifest recorded "
                     f"{files[f].get('size') if isinstance(files[f], dict) else files[f]!r}: not the source converted")
    return src


def _compare_plan(plan: Plan, lay: Layout, reader: OutputReader, rep: VerifyReport) -> None:
    manifest = lay.manifest or {}
    records = manifest.get("tensors", {})
    problems = []
    planned = {o.name: o for o in plan.outputs}
    for name in sorted(set(planned) - set(records)):
        problems.append((name, None, "the plan re-made from the source has this tensor; the conversion lacks it"))
    for name in sorted(set(records) - set(planned)):
        problems.append((name, lay.shard_of.get(name), "not produced by the plan re-made from the source"))
    for name, o in planned.items():
        if name in reader.info:
            shard, info = reader.info[name]
            if (info.dtype, info.shape) != (o.dtype, o.shape):
                problems.append((name, shard, f"is {info.dtype} {list(info.shape)}, the plan says {o.dtype} {list(o.shape)}"))
        rec = records.get(name)
        try:
            has_row_tiles(manifest, name)  # the runtime's check: a layout it refuses is named as such
        except FormatError as exc:
            problems.append((name, lay.shard_of.get(name), str(exc)))
            continue
        if rec is not None and (rec.get("sources") != o.sources or rec.get("transform") != o.transform):
            problems.append((name, lay.shard_of.get(name), "the manifest's sources/transform differ from the plan"))
    for t, s, m in problems[:50]:
        rep.fail(t, s, m)
    if len(problems) > 50:
        rep.fail(None, None, f"... and {len(problems) - 50} more plan disagreements")


def _hash_shards(out: Path, lay: Layout, pool: ThreadPoolExecutor, tick: Callable[[int], None]) -> dict[str, Future]:
    def job(name: str) -> str:
        digest = sha256_file(out / name)
        tick(os.path.getsize(out / name))
        return digest
    return {name: pool.submit(job, name) for name in lay.headers}


@dataclass
class _JobResult:
    """What one job found; applied to the report in job order by the main thread."""

    failures: list[tuple[str | None, str | None, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    updates: dict[str, dict] = field(default_factory=lambda: defaultdict(dict))

    def apply(self, rep: VerifyReport) -> None:
        for name, attrs in self.updates.items():
            if name in rep.tensors:
                for k, v in attrs.items():
                    setattr(rep.tensors[name], k, v)
        for t, s, m in self.failures:
            rep.fail(t, s, m)
        rep.warnings.extend(self.warnings)


class _Verifier:
    """Runs the value checks and the round trip, one job per NVFP4 group or passthrough tensor."""

    def __init__(self, out: Path, lay: Layout, src: LocalSource | None, plan: Plan | None):
        self.out, self.lay, self.src = out, lay, src
        self.tick: Callable[[int], None] = lambda n: None
        self.reader = OutputReader(out, lay)
        self.units: dict[str, FusedMatrices] = {}
        self.copies: dict[str, Passthrough] = {}
        if plan is not None:
            for u in plan.units:
                if isinstance(u, FusedMatrices):
                    self.units[u.weight.name] = u
                elif isinstance(u, Passthrough):
                    self.copies[u.name] = u

    def jobs(self) -> list[tuple[str, str, int]]:
        """(kind, name, bytes to read) in file order."""
        out = []
        groups = nvfp4_groups(self.reader.info)
        roles = ("weight", "weight_scale", "alpha", "input_scale", "input_global_scale")
        grouped = {f"{g}.{r}" for g in groups for r in roles}
        for g in groups:
            w = self.reader.info[g + ".weight"][1]
            trip = g + ".weight" in self.units
            n = self.reader.info[g + ".weight_scale"][1].nbytes + (w.nbytes if trip else 0)
            out.append(("group", g, n))
        for name in self.copies:
            if name in self.reader.info and name not in grouped:
                out.append(("copy", name, self.reader.info[name][1].nbytes))
        if self.src is None:  # no round trip: the values of every other tensor are still screened
            for name, (_, info) in self.reader.info.items():
                if name not in grouped:
                    out.append(("values", name, info.nbytes))
        pos = lambda j: self.reader.info[j[1] + (".weight" if j[0] == "group" else "")]  # noqa: E731
        return sorted(out, key=lambda j: (pos(j)[0], pos(j)[1].start))

    def run_job(self, kind: str, name: str) -> _JobResult:
        res = _JobResult()
        try:
            if kind == "group":
                self.group(name, res)
            elif kind == "values":
                self.values(name, res)
            else:
                self.copy(name, res)
        except Exception as exc:  # noqa: BLE001 - any surprise is a failure of this tensor, not a crash
            tensor = name + (".weight" if kind == "group" else "")
            res.failures.append((tensor, self.lay.shard_of.get(tensor), f"could not be checked: {exc}"))
        return res

    def _problems(self, per_tensor: dict[str, list[str]], res: _JobResult) -> None:
        for tensor, msgs in per_tensor.items():
            shard = self.lay.shard_of.get(tensor)
            for m in msgs[:PROBLEMS_PER_TENSOR]:
                res.failures.append((tensor, shard, m))
            if len(msgs) > PROBLEMS_PER_TENSOR:
                res.failures.append((tensor, shard, f"... and {len(msgs) - PROBLEMS_PER_TENSOR} more problems of "
                                     "this tensor"))

    def group(self, prefix: str, res: _JobResult) -> None:
        names = {"weight": prefix + ".weight", "weight_scale": prefix + ".weight_scale", "alpha": prefix + ".alpha"}
        w_info = self.reader.info[names["weight"]][1]
        stacked = len(w_info.shape) == 3
        items = range(w_info.shape[0]) if stacked else [None]
        rows, kb = w_info.shape[-2], scale_cols(w_info.shape[-1])
        unit = self.units.get(names["weight"])
        acc = UnitCheck()
        found: dict[str, list[str]] = defaultdict(list)
        inp = unit.input_scale if unit is not None else None
        for e in items:
            scales = self.reader.read(names["weight_scale"], e)
            alphas = tuple(float(a) for a in self.reader.read(names["alpha"], e).reshape(-1))
            at = f" [expert {e}]" if e is not None else ""
            if not all(math.isfinite(a) and a > 0 for a in alphas):
                found[names["alpha"]].append(f"alpha{at} is {list(alphas)!r}; it must be finite and positive")
            pad = swizzle_padding(scales, rows, kb)
            if pad.any():
                found[names["weight_scale"]].append(f"{int((pad != 0).sum())} swizzle padding bytes{at} are not zero")
            nan = sum(int((scales == b).sum()) for b in E4M3_NAN_BYTES)
            if nan:
                found[names["weight_scale"]].append(f"{nan} NaN E4M3 bytes (0x7F/0xFF){at}")
            if unit is not None:
                packed = self.reader.read(names["weight"], e)
                if unit.row_tiles:
                    packed = untile_rows(packed)
                parts = len(unit.members[e or 0])
                if len(alphas) == 1:
                    alphas *= parts  # a dense fused linear: one alpha shared by its parts
                CHECKS[unit.fmt](Item(e, packed, scales, alphas, names), unit.members[e or 0], self.src.read, acc)
                if inp is not None and inp.name in self.reader.info:
                    self.input_scale(inp.name, e, unit.members[e or 0], found, res)
            self.tick(scales.numel() + (w_info.nbytes // len(items) if unit is not None else 0))
        for tensor, msg in acc.problems:
            found[tensor].append(msg)
        if unit is not None:
            self.record(unit, names, acc, found, res)
        self._problems(found, res)

    def input_scale(self, name: str, e: int | None, item: list[dict[str, str]], found: dict[str, list[str]],
                    res: _JobResult) -> None:
        got = self.reader.read(name, e).reshape(-1).float()
        role = "input_scale" if "input_scale" in item[0] else "input_global_scale"  # ModelOpt / compressed-tensors
        want = torch.cat([self.src.read(p[role]).float().reshape(-1) for p in item])
        if got.shape != want.shape or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            where = f" [expert {e}]" if e is not None else ""
            found[name].append(f"values{where} {got.tolist()} differ from "
                               f"{', '.join(p[role] for p in item)} = {want.tolist()}")
        else:
            res.updates[name]["checked"] = "round trip"

    def record(self, unit: FusedMatrices, names: dict[str, str], acc: UnitCheck, found: dict[str, list[str]],
               res: _JobResult) -> None:
        lossy = unit.fmt == "fp8" or acc.lossy_items > 0
        records = (self.lay.manifest or {}).get("tensors", {})
        for role, tensor in names.items():
            upd = res.updates[tensor]
            upd.update(checked="round trip", kind="lossy" if lossy else "lossless", source_format=unit.fmt)
            rec = records.get(tensor, {})
            if unit.fmt != "fp8":
                upd["inexact_blocks"] = acc.inexact
                if bool(rec.get("lossless")) == lossy:
                    found[tensor].append(f"the manifest says lossless={rec.get('lossless')}, verify finds "
                                         f"{acc.inexact} inexact blocks")
                elif rec.get("inexact_blocks", acc.inexact) != acc.inexact:
                    res.warnings.append(f"{shown(tensor)}: the manifest counts {rec.get('inexact_blocks')} inexact "
                                        f"blocks, verify counts {acc.inexact}")
            if not lossy or role != "weight":
                continue
            err, recorded = acc.stats.result(), rec.get("error")
            upd.update(error=err, bound=BOUNDS[unit.fmt].as_dict(), manifest_error=recorded)
            found[tensor].extend(bound_violations(unit.fmt, acc))
            why = manifest_disagreement(err, recorded)
            if why:
                found[tensor].append(why)

    def _screen(self, name: str) -> tuple[ValueScreen, int]:
        shard, info = self.reader.info[name]
        return ValueScreen(name, shard, info.dtype, info.shape), DTYPES[info.dtype][1]

    def _screened(self, screen: ValueScreen, res: _JobResult) -> None:
        res.failures += [(screen.name, screen.file, p) for p in screen.problems()]

    def values(self, name: str, res: _JobResult) -> None:
        """No NaN/Inf float and no NaN 8-bit float code in tensor ``name`` (read in chunks)."""
        shard, info = self.reader.info[name]
        screen, size = self._screen(name)
        fd, chunk = self.reader.fd(shard), CHUNK - CHUNK % size
        for done in range(0, info.nbytes, chunk):
            data = os.pread(fd, min(chunk, info.nbytes - done), info.start + done)
            screen.update(tensor_from_bytes(data, TensorInfo(info.dtype, (len(data) // size,), 0, len(data))),
                          done // size)
            self.tick(len(data))
        self._screened(screen, res)

    def copy(self, name: str, res: _JobResult) -> None:
        shard, info = self.reader.info[name]
        fd_src, start, count = self.src.fd_and_range(name)
        if count != info.nbytes:
            res.failures.append((name, shard, f"holds {info.nbytes} bytes, the source tensor {count}"))
            return
        screen, size = self._screen(name)
        fd, done, chunk = self.reader.fd(shard), 0, CHUNK - CHUNK % size
        while done < count:
            n = min(chunk, count - done)
            a, b = os.pread(fd_src, n, start + done), os.pread(fd, n, info.start + done)
            if a != b:
                at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                res.failures.append((name, shard, f"differs from the source tensor at byte {done + at} "
                                     "(passthrough must be byte-identical)"))
                return
            screen.update(tensor_from_bytes(b, TensorInfo(info.dtype, (len(b) // size,), 0, len(b))), done // size)
            done += n
            self.tick(n)
        self._screened(screen, res)
        res.updates[name]["checked"] = "round trip"

    def run(self, jobs: list[tuple[str, str, int]], rep: VerifyReport, workers: int) -> None:
        """Run ``jobs`` on ``workers`` threads (at most 2 per worker in flight); apply results in order."""
        slots = threading.Semaphore(2 * max(1, workers))
        pending: deque[Future] = deque()

        def one(kind: str, name: str) -> _JobResult:
            try:
                return self.run_job(kind, name)
            finally:
                slots.release()

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            for kind, name, _ in jobs:
                slots.acquire()
                pending.append(pool.submit(one, kind, name))
                while pending and pending[0].done():
                    pending.popleft().result().apply(rep)
            while pending:
                pending.popleft().result().apply(rep)


def verify_checkpoint(out: str | os.PathLike, source: str | os.PathLike | None = None, fast: bool = False,
                      progress: bool = True, *, workers: int = DEFAULT_WORKERS,
                      structure_only: bool = False) -> VerifyReport:
    """Verify the converted checkpoint in ``out`` (see the module docstring for every check).

    ``source``: the source checkpoint folder; by default the local path the manifest recorded. When
    neither can be reached the round trip cannot be done, and the report fails saying so, unless
    ``structure_only`` is set: then only structure, hash and value checks run (``report.round_trip`` is
    false). ``fast`` skips the shard sha256 hashing (the round trip still compares every tensor with the
    source). Problems never raise: they are collected as :class:`Failure` entries of the returned
    :class:`VerifyReport`; only an unreadable ``out`` folder raises :class:`FileNotFoundError`.
    ``workers`` threads check groups in parallel (the report does not depend on it).
    """
    out = Path(out)
    problem = folder_problem(out)
    if problem is not None:
        raise FileNotFoundError(f"{out}: {problem}")
    rep = VerifyReport(str(out))
    lay = check_files(out, rep.fail, rep.warnings.append)
    if lay.manifest is None:
        return rep
    rep.shards = sorted(lay.manifest.get("shards", {}))
    for name, entry in lay.manifest.get("tensors", {}).items():
        rep.tensors[name] = TensorResult(name, lay.shard_of.get(name), tensor_kind(entry))
    for name, res in rep.tensors.items():
        if res.shard in lay.bad_shards:
            res.ok = False
            res.problems.append(f"not checked: shard {shown(res.shard)} is missing or unreadable")

    src = _open_source(source, lay.manifest, rep, structure_only)
    plan = None
    if src is not None:
        try:
            opts = lay.manifest.get("options")
            opts = opts if isinstance(opts, dict) else {}
            plan = make_plan(src, Options(dense=opts.get("dense", "nvfp4"),
                                          shard_size=int(opts.get("shard_size", DEFAULT_SHARD_SIZE)),
                                          target=opts.get("target", "sm100")))
        except (ConvertError, ValueError, TypeError) as exc:
            rep.fail(None, None, f"cannot re-make the plan from the source: {exc}")
    verifier = _Verifier(out, lay, src, plan)
    try:
        if plan is not None:
            _compare_plan(plan, lay, verifier.reader, rep)
            rep.round_trip = True
        else:
            verifier.src = None  # no plan: no round trip, every tensor's values screened instead
            try:
                config = ModelConfig.from_dict(read_json_object(out / "config.json", "a converted checkpoint carries "
                                                                "the source's config.json", FormatError))
            except FormatError as exc:
                rep.fail(None, "config.json", f"cannot read config.json: {exc}")
            else:
                check_against_config(config, lay, rep.fail)
        jobs = verifier.jobs()
        total = sum(n for _, _, n in jobs) + (0 if fast else sum(os.path.getsize(out / s) for s in lay.headers))
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as pool:
            verifier.tick = bar.update
            hashes = {} if fast else _hash_shards(out, lay, pool, bar.update)
            verifier.run(jobs, rep, workers)
            for name, fut in hashes.items():
                want = lay.manifest["shards"][name].get("sha256")
                if fut.result() != want:
                    rep.fail(None, name, f"sha256 {fut.result()} differs from the manifest's {want!r}: the shard "
                             "changed after conversion (copy it again, or convert again)")
        rep.hashed = not fast
    finally:
        verifier.reader.close()
        if src is not None:
            src.close()
    return rep


def format_report(rep: VerifyReport, worst: int = 3, listed: int = 50) -> str:
    """The human-readable summary: what was checked, the worst lossy tensors, every failure."""
    lines = [f"verify {rep.out}"]
    lines.append(f"  source:  {rep.source} (round trip against the source)" if rep.round_trip else
                 "  source:  none (structure, hash and value checks only; no round trip)")
    lines.append(f"  shards:  {len(rep.shards)} ({'sha256 checked' if rep.hashed else 'sha256 not checked (--fast)'})")
    kinds = Counter(r.kind for r in rep.tensors.values())
    checked = Counter(r.checked for r in rep.tensors.values())
    lines.append(f"  tensors: {len(rep.tensors)} ({counted(kinds)}); "
                 f"{checked.get('round trip', 0)} compared with the source")
    inexact = sum(r.inexact_blocks or 0 for n, r in rep.tensors.items() if n.endswith(".weight"))
    if rep.round_trip:
        lines.append(f"  inexact blocks on lossless paths (MXFP4 out-of-range fallback): {inexact}")
    lossy = sorted((r for r in rep.tensors.values() if r.error), key=lambda r: -r.error["rel_fro"])
    if lossy:
        by_path = Counter(r.source_format for r in lossy)
        lines.append(f"  worst lossy tensors per source format ({', '.join(f'{k} {v}' for k, v in sorted(by_path.items()))}):")
        lines.append(f"    {'tensor':48s} {'from':5s} {'rel_fro':>9s} {'max_abs':>9s} {'cosine':>8s} {'bound':>7s} "
                     f"{'manifest':>9s}")
        listed_lossy = [r for path in sorted(by_path) for r in [x for x in lossy if x.source_format == path][:worst]]
        for r in listed_lossy:
            rec = (r.manifest_error or {}).get("rel_fro")
            lines.append(f"    {shown(r.name):48s} {r.source_format or '':5s} {r.error['rel_fro']:9.3e} {r.error['max_abs']:9.3e} "
                         f"{r.error['cosine']:8.5f} {r.bound['rel_fro']:7.4f} "
                         f"{'-' if rec is None else format(rec, '9.3e'):>9s}")
    for w in rep.warnings[:listed]:
        lines.append(f"  warning: {w}")
    if rep.failures:
        lines.append(f"  FAILURES ({len(rep.failures)}):")
        lines += [f"    {f}" for f in rep.failures[:listed]]
        if len(rep.failures) > listed:
            lines.append(f"    ... and {len(rep.failures) - listed} more (see --json)")
    lines.append("OK: every check held" if rep.ok else f"FAILED: {len(rep.failures)} problems")
    return "\n".join(lines)
