"""Router test fixtures shared by modules that check both inner-loop paths."""

from __future__ import annotations

import pytest

from pdserve.router import kernels


@pytest.fixture(scope="module", params=["compiled", "numpy"])
def kernel_path(request):
    """Run a module once with the numba kernels and once with the numpy path they replace."""
    if request.param == "compiled" and not kernels.AVAILABLE:
        pytest.fail("numba is a dependency: the compiled kernels must be importable")
    saved = kernels.enabled
    kernels.enabled = request.param == "compiled"
    yield request.param
    kernels.enabled = saved
