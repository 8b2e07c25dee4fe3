"""The on-disk kernel cache of ``kernels/cute_host`` (CPU: compile for sm_90a, dump, load back; no launch)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types
import warnings

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import cute_host  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe_routing import Sm90MoeRouting  # noqa: E402

if os.environ["CUTE_DSL_ARCH"] != "sm_90a":
    pytest.skip("CUTE_DSL_ARCH is set to another target", allow_module_level=True)


def _routing_args(pairs: int = 18) -> list[torch.Tensor]:
    i32 = dict(dtype=torch.int32)
    return [torch.zeros(pairs, dtype=torch.int64), torch.zeros(pairs), torch.zeros(pairs, **i32), torch.zeros(pairs),
            torch.zeros(9, 3, **i32), torch.zeros(1, **i32), torch.zeros(pairs, **i32)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cute_host.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    monkeypatch.setattr(cute_host, "_UNWRITABLE", set())
    return tmp_path


def _no_compile(*_a, **_k):
    raise AssertionError("compiled although the kernel is in the disk cache")


def test_second_process_loads_instead_of_compiling(cache, monkeypatch):
    op, args = Sm90MoeRouting(experts=256, top_k=6, tile_tokens=8), _routing_args()
    first = cute_host.compile_op(op, args)
    files = list(cache.glob("*.o"))
    assert len(files) == 1 and files[0].stat().st_size > 1000
    monkeypatch.setattr(cute_host, "_COMPILED", {})  # a fresh process: only the disk is left
    import cutlass.cute as cute
    monkeypatch.setattr(cute, "compile", _no_compile)
    loaded = cute_host.compile_op(op, args)
    assert loaded is not first and callable(loaded) and type(loaded).__module__.startswith("tvm_ffi")


def test_the_key_tells_cpu_from_cuda_operands():
    """A function compiled on CPU stand-ins (CI) checks the device type of its arguments: a CUDA call must not get it
    from the in-process or the disk cache."""
    op, args = Sm90MoeRouting(experts=256, top_k=6, tile_tokens=8), _routing_args()
    on_meta = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    cpu, meta = cute_host.compile_key(op, args), cute_host.compile_key(op, on_meta)
    assert cpu != meta and cpu[:2] == meta[:2] and {d for *_, d in cpu[2]} == {"cpu"}


def test_collecting_lists_instead_of_compiling(cache):
    op, args = Sm90MoeRouting(experts=256, top_k=6, tile_tokens=8), _routing_args()
    with cute_host.collecting() as jobs:
        assert cute_host.compile_op(op, args) is None
    assert jobs == [(op, args)] and not list(cache.glob("*.o")) and not cute_host._COMPILED
    assert cute_host.compile_op(op, args) is not None  # outside the block: compiled


def test_compile_all_compiles_in_worker_processes_and_loads_here(cache, monkeypatch):
    """Two kernels compiled by two spawned workers into the disk cache; this process only loads them (its own
    compiler is made to fail), and a second call finds nothing left to compile."""
    jobs = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), _routing_args(12)) for t in (8, 16)]
    import cutlass.cute as cute
    monkeypatch.setattr(cute, "compile", _no_compile)
    report = []
    assert cute_host.compile_all(jobs, processes=2, report=report) == 2
    assert len(list(cache.glob("*.o"))) == 2
    assert all(cute_host.compile_key(op, args) in cute_host._COMPILED for op, args in jobs)
    assert [c.error for c in report] == [None, None] and all(c.seconds > 0 for c in report)
    assert len({c.worker for c in report}) == 2 and os.getpid() not in {c.worker for c in report}
    assert cute_host.compile_all(jobs, processes=2) == 0


def test_compiles_started_run_while_this_process_works_and_a_cancel_hands_out_no_more(cache, monkeypatch):
    """``start_compile_all`` returns while worker processes compile (this process's own compiler fails if asked);
    ``wait`` then loads what they stored. A cancelled start hands out no job past those running, loads nothing."""
    import cutlass.cute as cute
    monkeypatch.setattr(cute, "compile", _no_compile)
    jobs = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), _routing_args(12)) for t in (8, 16)]
    pending = cute_host.start_compile_all(jobs, processes=2)
    assert not cute_host._COMPILED   # nothing loaded yet: the call did not wait for the workers
    report = []
    assert pending.wait(report) == 2 and len(report) == 2
    assert all(cute_host.compile_key(op, args) in cute_host._COMPILED for op, args in jobs)
    more = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), _routing_args(12)) for t in (32, 48, 64, 80)]
    pending = cute_host.start_compile_all(more, processes=2)
    pending.cancel()
    assert len(list(cache.glob("*.o"))) <= 2 + 2   # at most one job a worker ran past the cancel
    assert not any(cute_host.compile_key(op, args) in cute_host._COMPILED for op, args in more)


def test_a_pool_started_early_compiles_the_jobs_or_ends_when_there_are_none(cache, monkeypatch):
    """A ``WorkerPool`` started before the jobs are known (as ``load_model`` starts one) compiles them in its forked
    workers; given nothing to compile (every kernel cached) it is ended at once."""
    import cutlass.cute as cute
    from nvfp4_megamoe.kernels.compile_workers import WorkerPool
    monkeypatch.setattr(cute, "compile", _no_compile)
    jobs = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), _routing_args(12)) for t in (8, 16)]
    pool = WorkerPool(3)
    report = []
    assert cute_host.start_compile_all(jobs, pool=pool).wait(report) == 2
    assert [c.error for c in report] == [None, None] and len({c.worker for c in report}) == 2
    assert pool.process.returncode == 0 and all(c.closed for pair in pool.channels for c in pair)
    idle = WorkerPool(2)
    assert cute_host.start_compile_all(jobs, pool=idle).wait() == 0   # all cached now
    assert idle.process.returncode is not None and all(c.closed for pair in idle.channels for c in pair)


def test_workers_that_die_leave_their_jobs_to_this_process(cache):
    """A pool whose interpreter is gone (killed, say, for memory) fails the jobs it was handed and leaves the rest
    unhanded; this process then compiles every one of them itself, with a warning, and the run goes on."""
    from nvfp4_megamoe.kernels.compile_workers import WorkerPool
    jobs = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), _routing_args(12)) for t in (8, 16, 32)]
    pool = WorkerPool(2)
    pool.process.kill()
    pool.process.wait()
    report = []
    with pytest.warns(UserWarning, match="3 of 3 kernels failed to compile in worker processes"):
        assert cute_host.start_compile_all(jobs, pool=pool).wait(report) == 3
    assert sorted(c.error for c in report) == ["no worker process left"] + ["the worker process ended"] * 2
    assert all(cute_host.compile_key(op, args) in cute_host._COMPILED for op, args in jobs)


_UNGUARDED_SCRIPT = '''
import os, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
from nvfp4_megamoe.kernels import cute_host
from nvfp4_megamoe.kernels.sm90_moe_routing import Sm90MoeRouting
import torch
args = [torch.zeros(12, dtype=torch.int64), torch.zeros(12), torch.zeros(12, dtype=torch.int32), torch.zeros(12),
        torch.zeros(9, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(12, dtype=torch.int32)]
jobs = [(Sm90MoeRouting(experts=64, top_k=4, tile_tokens=t), args) for t in (8, 16)]
report = []
print(cute_host.compile_all(jobs, processes=2, report=report), len({c.worker for c in report}))
'''


def test_compiling_workers_do_not_run_the_users_script(cache, tmp_path):
    """A script without an ``if __name__ == "__main__":`` guard compiles in worker processes that do not run it
    again (multiprocessing's spawned workers re-run the main script: a model loaded in every worker)."""
    script, runs = tmp_path / "user_script.py", tmp_path / "runs.txt"
    script.write_text(_UNGUARDED_SCRIPT)
    res = subprocess.run([sys.executable, "-W", "error", str(script), str(runs)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["2", "2"]  # two kernels compiled, by two workers
    assert len(runs.read_text().split()) == 1 and len(list(cache.glob("*.o"))) == 2


def test_a_job_a_worker_cannot_read_is_compiled_here(cache):
    """A job whose op the workers cannot unpickle (its class lives only in this process) comes back as failed,
    with a warning, and this process compiles it; the other job is the workers'."""
    here_only = types.ModuleType("only_in_this_process")
    local = type("LocalRouting", (Sm90MoeRouting,), {"__module__": here_only.__name__})
    here_only.LocalRouting = local
    sys.modules[here_only.__name__] = here_only
    try:
        jobs = [(local(experts=64, top_k=4, tile_tokens=8), _routing_args(12)),
                (Sm90MoeRouting(experts=64, top_k=4, tile_tokens=16), _routing_args(12))]
        report = []
        with pytest.warns(UserWarning, match="1 of 2 kernels failed .*LocalRouting.*only_in_this_process"):
            assert cute_host.compile_all(jobs, processes=2, report=report) == 2
    finally:
        del sys.modules[here_only.__name__]
    assert sorted((c.name, c.error is None) for c in report) == [("LocalRouting", False), ("Sm90MoeRouting", True)]
    assert all(cute_host.compile_key(op, args) in cute_host._COMPILED for op, args in jobs)


def test_a_worker_compiles_for_cuda_operands_without_cuda(cache):
    """A compiling worker describes CUDA operands as CuTe fake tensors in global memory (no CUDA context): the
    stored kernel is the one for CUDA tensors (its machine code equals that compiled from CUDA tensors, see
    docs/design/runtime.md), so it refuses the CPU tensors that a CPU compile of the same op takes."""
    op, args = Sm90MoeRouting(experts=64, top_k=4, tile_tokens=8), _routing_args(12)
    specs = [cute_host._operand_spec(a) for a in args]
    on_cuda = [(shape, dtype, "cuda", aligned) for shape, dtype, _, aligned in specs]
    where = (cache / "k.o", "kcuda")
    assert cute_host._compile_share([(op, on_cuda, where)]) == 1
    with pytest.raises(ValueError, match="expected device_type=cuda"):
        cute_host._load_cached(where)(*args, 0)
    on_cpu = (cache / "c.o", "kcpu")
    cute_host._compile_share([(op, specs, on_cpu)])
    with pytest.raises(RuntimeError, match="(?i)cuda runtime"):  # past the operand checks, to the launch
        cute_host._load_cached(on_cpu)(*args, 0)
    assert not torch.cuda.is_initialized()


class _ClaimsCuda:
    """A CPU tensor that exports itself through DLPack as a CUDA tensor: what CuTeDSL sees of a real one when it
    compiles (it reads no memory), on a machine without a GPU."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __dlpack_device__(self):
        return 2, 0  # kDLCUDA, device 0

    def __dlpack__(self, stream=None, **_kw):
        capsule = torch.utils.dlpack.to_dlpack(self.t)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        # DLTensor: void *data, then DLDevice {int32 device_type, int32 device_id}
        ctypes.c_int32.from_address(get(capsule, b"dltensor") + ctypes.sizeof(ctypes.c_void_p)).value = 2
        return capsule


def test_a_workers_stand_ins_compile_to_the_code_of_cuda_tensors(tmp_path):
    """The fake tensors a worker compiles from give the object file that CUDA tensors give (kernel and host code;
    only the symbol names, which spell the argument types, differ)."""
    from cutlass.cute.runtime import from_dlpack

    from kernel_resources_probe import elf_sections

    op, args = Sm90MoeRouting(experts=64, top_k=4, tile_tokens=8), _routing_args(12)
    args[1] = torch.zeros(13)[1:]  # one operand not 16-byte aligned
    cuda = [from_dlpack(_ClaimsCuda(a), assumed_align=cute_host._alignment(a), enable_tvm_ffi=True)
            .mark_layout_dynamic(leading_dim=a.dim() - 1) for a in args]
    fakes = [cute_host._operand((shape, dtype, "cuda", aligned))
             for shape, dtype, _, aligned in map(cute_host._operand_spec, args)]
    objects = []
    for operands in (cuda, fakes):
        fn = cute_host.compile_described(op, operands)
        fn.export_to_c(str(tmp_path / "k.o"), "k")
        objects.append({name: data for name, data in elf_sections((tmp_path / "k.o").read_bytes()).items()
                        if name not in (".symtab", ".strtab")})
    assert objects[0] == objects[1] and any(len(data) > 1000 for data in objects[0].values())


def test_other_configurations_get_other_files(cache):
    cute_host.compile_op(Sm90MoeRouting(experts=256, top_k=6, tile_tokens=8), _routing_args())
    cute_host.compile_op(Sm90MoeRouting(experts=256, top_k=6, tile_tokens=16), _routing_args())
    assert len(list(cache.glob("*.o"))) == 2


def test_a_damaged_file_is_compiled_again_and_replaced(cache, monkeypatch):
    op, args = Sm90MoeRouting(experts=64, top_k=4, tile_tokens=8), _routing_args(12)
    cute_host.compile_op(op, args)
    (path,) = cache.glob("*.o")
    path.write_bytes(b"not an object file")
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    with pytest.warns(UserWarning, match="did not load"):
        assert cute_host.compile_op(op, args) is not None
    assert path.stat().st_size > 1000  # the fresh compile took its place


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh process with an empty home: no cache variable, nothing compiled, HOME in tmp."""
    monkeypatch.delenv(cute_host.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    monkeypatch.setattr(cute_host, "_UNWRITABLE", set())
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def test_on_by_default_in_the_user_cache(home):
    cute_host.compile_op(Sm90MoeRouting(experts=32, top_k=2, tile_tokens=8), _routing_args(6))
    folder = home / ".cache" / "nvfp4_megamoe" / "kernels"
    assert cute_host.cache_folder() == folder and len(list(folder.glob("*.o"))) == 1


def test_default_follows_xdg_cache_home(home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cute_host.cache_folder() == tmp_path / "xdg" / "nvfp4_megamoe" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec says to ignore it
    assert cute_host.cache_folder() == home / ".cache" / "nvfp4_megamoe" / "kernels"
    monkeypatch.setenv(cute_host.CACHE_ENV, str(tmp_path / "mine"))  # the variable wins
    assert cute_host.cache_folder() == tmp_path / "mine"


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", "None", "", " off "])
def test_turned_off(value, home, monkeypatch):
    monkeypatch.setenv(cute_host.CACHE_ENV, value)
    assert cute_host.cache_folder() is None


def test_turned_off_writes_nothing(home, tmp_path, monkeypatch):
    monkeypatch.setenv(cute_host.CACHE_ENV, "off")
    assert cute_host.compile_op(Sm90MoeRouting(experts=32, top_k=2, tile_tokens=8), _routing_args(6)) is not None
    assert not any(tmp_path.rglob("*.o"))


def test_an_unwritable_folder_warns_once_and_compiles(cache, monkeypatch):
    (cache / "a_file").write_bytes(b"")  # a folder below a file cannot be made, whoever runs the test (root too)
    monkeypatch.setenv(cute_host.CACHE_ENV, str(cache / "a_file" / "kernels"))
    with pytest.warns(UserWarning, match="not writable"):
        fn = cute_host.compile_op(Sm90MoeRouting(experts=32, top_k=2, tile_tokens=8), _routing_args(6))
    assert callable(fn) and "TVMFFIJitCompiledFunction" in type(fn).__name__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next kernel neither warns nor tries the folder again
        fn = cute_host.compile_op(Sm90MoeRouting(experts=32, top_k=2, tile_tokens=16), _routing_args(6))
    assert "TVMFFIJitCompiledFunction" in type(fn).__name__ and not any(cache.rglob("*.o"))
