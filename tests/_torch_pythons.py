"""The CUDA builds of torch the tests judge by (GMP_TORCH_PYTHONS: their
pythons, separated by os.pathsep; tools/torch_slim.py makes slim installs,
.ci/test exports them), and what a test does where there are none."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

PYTHONS = [p for p in os.environ.get("GMP_TORCH_PYTHONS", "").split(os.pathsep) if p]
#: .ci/run sets GMP_REQUIRE_TORCH_ORACLE=1: there, no torch is a failure, not a skip.
REQUIRED = os.environ.get("GMP_REQUIRE_TORCH_ORACLE") == "1"


def no_torch() -> NoReturn:
    """Fail (where torch is required) or skip a test that needs a torch python."""
    if REQUIRED:
        pytest.fail("GMP_REQUIRE_TORCH_ORACLE=1 but GMP_TORCH_PYTHONS names no torch (tools/torch_slim.py)")
    pytest.skip("no CUDA build of torch: set GMP_TORCH_PYTHONS (tools/torch_slim.py makes slim installs)")
