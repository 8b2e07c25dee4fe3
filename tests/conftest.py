"""Session-wide test settings."""

from __future__ import annotations

import pytest

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
