"""Session-wide test settings."""

from __future__ import annotations

import os

# Every CuTeDSL kernel here targets sm_90a, and CuTeDSL fixes its target when first imported: set it before any test
# module imports it (on a machine without a GPU it would otherwise compile for sm_100a), whatever the modules' order.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

from nvfp4_megamoe.kernels.cute_host import CACHE_ENV  # noqa: E402


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
