"""Which of torch's allocator settings the fidelity matrix has proven the
engine exact for, per torch version: ``proven.json`` beside this file,
written by ``benchmarks/fidelity.py`` from its run.

A setting is proven for a version when, on every trace where the engine
matches torch under the defaults, it also matches torch at every event
under each value of that setting tried (so a difference the defaults share,
such as one in ``empty_cache``, is not charged to each setting). ``tune``
recommends only proven settings for the torch version it models and marks
the others unverified.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

__all__ = ["MODELLED", "installed_torch_version", "modelled_version", "proven_settings"]

_FILE = Path(__file__).resolve().parent / "proven.json"


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    try:
        data = json.loads(_FILE.read_text())
    except (OSError, ValueError):
        return {"versions": {}}
    return data if isinstance(data, dict) else {"versions": {}}


#: The torch versions (major.minor) the matrix has judged, oldest first.
MODELLED: tuple[str, ...] = tuple(sorted(_table().get("versions", {}), key=lambda v: tuple(map(int, v.split(".")))))


def minor_version(version: str) -> str:
    """``"2.11"`` of ``"2.11.0+cu130"``: the major.minor a version string names."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def installed_torch_version() -> Optional[str]:
    """The version of the torch this Python would import, read from its
    ``version.py`` without importing it (None without torch)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        for line in path.read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("'\"")
    except OSError:
        pass
    return None


def modelled_version(installed: Optional[str]) -> str:
    """The version whose rules apply: the installed torch's (major.minor)
    when it was judged, else the newest judged version not newer than it,
    else the newest judged (no torch installed)."""
    if not MODELLED:
        return minor_version(installed) if installed else ""
    if not installed:
        return MODELLED[-1]
    want = tuple(map(int, minor_version(installed).split(".")))
    older = [v for v in MODELLED if tuple(map(int, v.split("."))) <= want]
    return older[-1] if older else MODELLED[0]


def proven_settings(version: str) -> frozenset[str]:
    """The replay policy keys proven for ``version`` (major.minor)."""
    v = _table().get("versions", {}).get(minor_version(version), {})
    return frozenset(k for k, ok in v.items() if ok)
