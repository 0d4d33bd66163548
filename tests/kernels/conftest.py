"""Fixtures the kernel tests share."""

import pytest

from tokenbus_kernels import cpu


@pytest.fixture(scope="module")
def ext():
    """The C++ CPU kernels, built for this machine (a failed build fails the test: it is what they test)."""
    module = cpu.extension()
    assert module is not None, "the C++ CPU kernels did not build (see the cpu_kernels_unavailable warning)"
    return module
