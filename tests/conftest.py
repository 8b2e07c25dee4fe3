"""Session-wide test settings and the fixtures every module shares."""

from __future__ import annotations

import functools
import os

# Every CuTeDSL kernel here targets sm_90a, and CuTeDSL fixes its target when first imported: set it before any test
# module imports it (on a machine without a GPU it would otherwise compile for sm_100a), whatever the modules' order.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

from nvfp4_megamoe.kernels.cute_host import CACHE_ENV  # noqa: E402
from synth_checkpoints import SynthCheckpoints  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache_in_tmp(tmp_path_factory):
    """Compiled kernels go to a session tmp folder, never the user's ``~/.cache`` (``kernels/cute_host``).

    A test that sets ``NVFP4_MEGAMOE_KERNEL_CACHE`` itself (monkeypatch) overrides this for its own run;
    set here in ``os.environ`` so that subprocesses the tests start inherit it too.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("kernel_cache")))
        yield


@pytest.fixture(scope="module")
def one_thread():
    """The reference ops are many small kernels: on a shared 2-core CI box OpenMP threads spinning
    against other processes make them ~30x slower than one thread. Modules ask for it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def synth_checkpoints(tmp_path_factory) -> SynthCheckpoints:
    """Synthetic checkpoints and conversions, each (variant, options) built once per session and shared
    read-only (``tests/synth_checkpoints.py``): ``synth_checkpoints.source("flash")``,
    ``synth_checkpoints.converted("modelopt", dense="keep")``; copy one with ``writable_copy`` to change it."""
    return SynthCheckpoints(tmp_path_factory.mktemp("checkpoints"))


@functools.cache
def _no_hopper_gpu() -> str | None:
    """Why the ``gpu`` tests cannot run here, or None where they can."""
    from nvfp4_megamoe.runtime.hopper import hopper_available

    if hopper_available("cuda"):
        return None
    if not torch.cuda.is_available():
        return "marked gpu: needs an sm_90 CUDA GPU and CuTeDSL; torch sees no CUDA device"
    found = torch.cuda.get_device_capability()
    if found != (9, 0):
        return f"marked gpu: needs an sm_90 CUDA GPU and CuTeDSL; the GPU is sm_{found[0]}{found[1]}"
    return "marked gpu: needs an sm_90 CUDA GPU and CuTeDSL; nvidia-cutlass-dsl (cutlass) is not importable"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one GPU skip: a test marked ``gpu`` runs only on an sm_90 GPU with CuTeDSL
    (``runtime.hopper.hopper_available``), and says why it did not run elsewhere."""
    if item.get_closest_marker("gpu") is not None:
        reason = _no_hopper_gpu()
        if reason is not None:
            pytest.skip(reason)
