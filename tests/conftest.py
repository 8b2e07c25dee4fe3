"""Session-wide test settings."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.cute_host import CACHE_ENV


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
