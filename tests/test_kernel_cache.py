"""The on-disk kernel cache of ``kernels/cute_host`` (CPU: compile for sm_90a, dump, load back; no launch)."""

from __future__ import annotations

import os

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
    assert loaded is not first and type(loaded).__name__.endswith("JitCompiledFunction")


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


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(cute_host.CACHE_ENV, raising=False)
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    monkeypatch.chdir(tmp_path)
    cute_host.compile_op(Sm90MoeRouting(experts=32, top_k=2, tile_tokens=8), _routing_args(6))
    assert not any(tmp_path.rglob("*.o"))
