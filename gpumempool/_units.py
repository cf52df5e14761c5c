"""Byte counts for people: the one formatter the CLI, the demo, the memory
summary and the plots share. (Text that must read as the engine's messages
do asks the engine: ``bindings.FailedRequest``.)"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.50 KiB"``, ... up to TiB,
    with ``digits`` decimals above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

