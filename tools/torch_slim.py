#!/usr/bin/env python3
"""Slim installs of PyPI's CUDA builds of torch, one virtualenv per version,
for the torch oracle (gpumempool.oracle) and the tests that run real torch on
the fake CUDA stack.

    python tools/torch_slim.py 2.5.1 2.11.0 2.15.0     # prints each venv's python, one a line

Each venv gets ``torch==VERSION`` without its NVIDIA dependencies
(``--no-deps``), torch's pure-Python requirements, and the CUDA runtime wheel
of torch's CUDA release for its headers (``nvidia-cuda-runtime-cu12`` or
``nvidia-cuda-runtime`` 13.x): about 0.5 GB instead of 3 GB. The NVIDIA
libraries torch links are replaced at run time by the oracle's stand-ins.
Each venv also gets what the real-torch tests need to run there
(tests/_torch_versions.py runs them with gpumempool on PYTHONPATH): pytest,
and gpumempool's own requirement, tqdm.

Venvs are kept in ``--cache`` (default ``$GMP_TORCH_CACHE``, else
``~/.cache/gpumempool/torch-slim``) and reused while complete; a failed
install leaves nothing behind. Progress goes to stderr, the pythons to
stdout. Exit status 1 (with one line per failure) if any version could not
be installed, e.g. offline.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: What the real-torch tests run in each venv need besides torch.
_TEST_REQUIREMENTS = ("pytest", "tqdm")

#: Requirements that are NVIDIA's libraries (replaced by stand-ins) or
#: triton (only for torch.compile): never installed.
_SKIP = re.compile(r"^(nvidia-|cuda-|triton)", re.I)


def _pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-conflicts", *args], check=True,
                   stdout=sys.stderr)


def _metadata(venv: Path) -> list[str]:
    dist = next(venv.glob("lib/python*/site-packages/torch-*.dist-info"))
    return [line.split(":", 1)[1].strip() for line in (dist / "METADATA").read_text().splitlines()
            if line.startswith("Requires-Dist:")]


def _runtime_requirement(requires: list[str]) -> str:
    """The CUDA runtime wheel of torch's CUDA release (for its headers)."""
    for req in requires:
        m = re.match(r"nvidia-cuda-runtime(-cu\d+)?\s*\(?\s*==\s*([\d.]+)", req)
        if m:
            return f"nvidia-cuda-runtime{m.group(1) or ''}=={m.group(2)}"
        m = re.match(r"cuda-toolkit\[[^\]]*cudart[^\]]*\]\s*==\s*(\d+)\.(\d+)", req)
        if m:
            return f"nvidia-cuda-runtime=={m.group(1)}.{m.group(2)}.*"
    raise RuntimeError("torch's metadata names no CUDA runtime: not a CUDA build")


def install(version: str, cache: Path) -> Path:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    venv = cache / f"torch-{version}-{tag}"
    py = venv / "bin" / "python"
    if (venv / ".complete").is_file() and py.exists():
        if not (venv / "bin" / "pytest").exists():  # made before the venvs had them
            _pip(py, *_TEST_REQUIREMENTS)
        return py
    shutil.rmtree(venv, ignore_errors=True)
    try:
        print(f"torch_slim: installing torch {version} into {venv}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(py, "--no-deps", f"torch=={version}")
        requires = _metadata(venv)
        pure = [r for r in requires if "extra ==" not in r and not _SKIP.match(r)]
        # "name (>=1.0) ; marker" (old metadata) is not a pip requirement: drop the parentheses.
        pure = [re.sub(r"\s*\(([^)]*)\)", r" \1", r) for r in pure]
        _pip(py, *pure, "numpy", *_TEST_REQUIREMENTS)
        _pip(py, "--no-deps", _runtime_requirement(requires))
        (venv / ".complete").write_text(version + "\n")
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    return py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="+", metavar="VERSION")
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("GMP_TORCH_CACHE") or Path.home() / ".cache/gpumempool/torch-slim"))
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    failed = 0
    for v in args.versions:
        try:
            print(install(v, args.cache))
        except (subprocess.CalledProcessError, RuntimeError, OSError, StopIteration) as e:
            print(f"torch_slim: torch {v} could not be installed: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
