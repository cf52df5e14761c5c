"""Types of the C extension gpumempool._fastcall (see _fastcall.c)."""

def bind(library_path: str, /) -> None: ...
def alloc(handle: int, size: int, device: int, stream: int, /) -> int: ...
def free(handle: int, address: int, /) -> None: ...
def scan_pickle(
    data: bytes | bytearray | memoryview, max_depth: int, /
) -> tuple[int | None, int] | tuple[bool, str, int, int]:
    """Accepted: ``(nodes, depth)``, the bound on what the pickle builds
    (``nodes`` None when there is none). Refused: ``(truncated, why, ops,
    pos)``."""
