"""Byte counts for people: the one formatter the CLI, the demo, the memory
summary and the plots share; and the engine's own form of a byte count
(``engine_bytes``), for text that must read as the engine's messages do (a
pool's name as they quote it comes from the engine: ``bindings.QuoteName``)."""

from __future__ import annotations

__all__ = ["engine_bytes", "format_bytes"]


def format_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.50 KiB"``, ... up to TiB,
    with ``digits`` decimals above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def engine_bytes(n: int) -> str:
    """``n`` bytes as the engine writes them (gocore.FormatBytes): ``"100 B"``,
    ``"20.00 MiB"``, ... up to EiB."""
    if n < 1024:
        return f"{n} B"
    div, exp, m = 1024, 0, n // 1024
    while m >= 1024 and exp < 5:
        div, exp, m = div * 1024, exp + 1, m // 1024
    return f"{float(n) / float(div):.2f} {'KMGTPE'[exp]}iB"
