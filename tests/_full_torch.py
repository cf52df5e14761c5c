"""A "full" torch install made from a slim one (tools/torch_slim.py), for
the tests that the oracle needs no compiler where torch has its NVIDIA
libraries (what `pip install torch` gives): a site directory whose torch is
a link to the slim install's, with the stand-ins the oracle builds for the
slim install put where torch's RPATH looks for NVIDIA's wheels
(site/nvidia/*/lib), and a python wrapper that puts that site first."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path


def full_torch(slim_python: str, tmp: Path) -> str:
    """The path of a python whose torch is ``slim_python``'s with every
    NVIDIA library it needs present. Builds the stand-ins with cc (before a
    test hides the compilers)."""
    from gpumempool.oracle import _stack

    torch = _stack.find_torch(slim_python)
    built = _stack.build(torch, tmp / "standin-cache")
    standins = [Path(p) for p in built.preload[3:]]
    assert standins, f"torch {torch.version} at {torch.torch_dir} is not a slim install"
    site = tmp / "site"
    (site / "nvidia" / "gmp" / "lib").mkdir(parents=True)
    for lib in standins:
        shutil.copy2(lib, site / "nvidia" / "gmp" / "lib" / lib.name)
    # The common stand-in holds the unversioned symbols of the libraries
    # without symbol versions (NCCL, cuSPARSELt, ...) but also the driver's
    # that torch imports: preloaded (below) ahead of the fake driver, it
    # must not have those.
    common_src = (built.directory / "common.c").read_text()
    names = set(re.findall(r"^(?:int|const char \*)(?: )?(\w+)\(void\)", common_src, re.M))
    driver = _stack._imports(Path(built.preload[0]))[2]
    src = tmp / "common.c"
    src.write_text(_stack._stub_source(names - driver))
    _stack._compile(_stack._cc(), site / "nvidia" / "gmp" / "lib" / "libgmp_nvidia_common.so", [src],
                    "-Wl,-soname,libgmp_nvidia_common.so")
    # torch's libraries look in $ORIGIN/../../nvidia/*/lib, and the loader
    # takes $ORIGIN from the path it opened (links unresolved) but the
    # kernel resolves "..": torch and torch/lib are real directories here,
    # of links to the slim install's files.
    (site / "torch" / "lib").mkdir(parents=True)
    for entry in torch.torch_dir.iterdir():
        if entry.name != "lib":
            (site / "torch" / entry.name).symlink_to(entry)
    for entry in (torch.torch_dir / "lib").iterdir():
        (site / "torch" / "lib" / entry.name).symlink_to(entry)
    for lib in _stack._torch_libraries(torch.torch_dir):
        for d in _stack._rpath_dirs(lib):
            parts = d.resolve().relative_to(torch.torch_dir.parent).parts if _under(d, torch.torch_dir.parent) else ()
            if len(parts) == 3 and parts[0] == "nvidia" and parts[2] == "lib":
                dest = site.joinpath(*parts)
                dest.mkdir(parents=True, exist_ok=True)
                for f in (site / "nvidia" / "gmp" / "lib").iterdir():
                    if not (dest / f.name).exists():
                        (dest / f.name).symlink_to(f)
    python = tmp / "python"
    # The stand-ins' unversioned symbols (NCCL's, cuSPARSELt's: libraries
    # without symbol versions) are all in one library, which the real ones
    # would define themselves: preloaded.
    common = site / "nvidia" / "gmp" / "lib" / "libgmp_nvidia_common.so"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} LD_PRELOAD={common} exec {slim_python} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def _under(d: Path, base: Path) -> bool:
    try:
        d.resolve().relative_to(base)
        return True
    except ValueError:
        return False


if __name__ == "__main__":  # python tests/_full_torch.py SLIM_PYTHON DIR: prints the wrapper's path
    print(full_torch(sys.argv[1], Path(sys.argv[2]).resolve()))
