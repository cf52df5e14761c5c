"""One error channel (issue 28): the engine's errors reach Python as one
structured value (bindings/pyerr: kind, message, fields) by every route -
gopy's wrappers, the C fast path, the C side's refusal of a forked child
read through ctypes - and the exceptions' attributes come from its fields,
never from the message."""

from __future__ import annotations

import ast
import ctypes
import json
import pathlib

import pytest

import gpumempool as gmp
from gpumempool import _errors, _native

MiB = 1 << 20
PACKAGE = pathlib.Path(gmp.__file__).parent


def _assert_oom_fields(err: gmp.OutOfMemoryError, *, requested: int, limit: int, where: str = "") -> None:
    assert err.kind == "OutOfMemoryError"
    assert (err.pool, err.backend, err.device) == ("errs", "sim", 0), err.fields
    assert (err.requested, err.limit, err.allocated) == (requested, limit, 0), err.fields
    assert err.segment is not None and err.segment >= requested
    assert err.reserved == 0 and err.cause == "" and err.device_total == 64 * MiB, err.fields
    assert str(err).startswith(where + 'pool "errs" (sim backend) out of memory on device 0'), str(err)


def test_out_of_memory_carries_its_fields_through_the_fast_path() -> None:
    with gmp.MemPool("sim", name="errs", capacity=64 * MiB, limit=4 * MiB) as pool:
        assert pool._fast is not None, "the C fast path is built"
        with pytest.raises(gmp.OutOfMemoryError) as info:
            pool.alloc(6 * MiB)
        _assert_oom_fields(info.value, requested=6 * MiB, limit=4 * MiB)


def test_out_of_memory_carries_its_fields_through_gopy() -> None:
    with gmp.MemPool("sim", name="errs", capacity=64 * MiB, limit=4 * MiB) as pool:
        with pytest.raises(gmp.OutOfMemoryError) as info:
            pool.alloc_segment(6 * MiB)  # gopy's wrapper (PoolAllocSegment)
        _assert_oom_fields(info.value, requested=6 * MiB, limit=4 * MiB)


@pytest.mark.parametrize("route", ["fast", "gopy"])
def test_every_kind_crosses_as_its_class(route: str) -> None:
    with gmp.MemPool("sim", name="errs", capacity=64 * MiB) as pool:
        if route == "gopy":
            pool._fast = None  # MemPool.alloc / free through gopy's wrappers
        a = pool.alloc(4096)
        with pytest.raises(gmp.InvalidPointerError) as bad:
            pool.free(12345)
        assert type(bad.value) is gmp.InvalidPointerError and bad.value.kind == "InvalidPointerError"
        assert "0x3039" in str(bad.value) and bad.value.fields == {}
        pool.free(a)
        with pytest.raises(gmp.DoubleFreeError) as double:
            pool.free(a)
        assert double.value.kind == "DoubleFreeError"


def test_the_raw_fast_path_raises_the_value() -> None:
    """The C fast path raises RuntimeError(value); translate makes it ours."""
    with gmp.MemPool("sim", capacity=64 * MiB) as pool:
        with pytest.raises(RuntimeError) as raw:
            _native.fastcall.alloc(pool.handle, 100, 9, 0)
        err = _errors.translate(raw.value)
        assert type(err) is gmp.InvalidArgumentError and err.kind == "InvalidArgumentError"
        assert json.loads(str(raw.value))["message"] == str(err)
        handle = pool.handle
    with pytest.raises(RuntimeError) as stale:
        _native.fastcall.free(handle, 4096)  # the handle of a closed pool: the engine's refusal
    err = _errors.translate(stale.value)
    assert type(err) is gmp.PoolClosedError and str(err) == f"pool handle {handle}: no such pool"


def test_the_kinds_of_go_and_python_agree() -> None:
    """bindings/pyerr owns the kinds; Python has a class for each, and no
    other."""
    assert set(json.loads(_native.bindings.ErrorKinds())) == set(_errors.KINDS)
    for kind, cls in _errors.KINDS.items():
        assert cls.kind == kind and issubclass(cls, gmp.GpuMemPoolError)


def test_text_that_is_no_value_is_a_backend_error() -> None:
    for text in ("gopy: bad argument", "OutOfMemoryError: the old form", "[1]", '{"message": "no kind"}'):
        err = _errors.translate(RuntimeError(text))
        assert type(err) is gmp.BackendError and str(err) == text and err.fields == {}
    err = _errors.translate(RuntimeError('{"kind": "SomethingNew", "message": "m", "fields": {"x": 1}}'))
    assert type(err) is gmp.BackendError and str(err) == "m" and err.fields == {"x": 1}


def test_python_made_errors_have_no_fields() -> None:
    err = gmp.OutOfMemoryError("made here")
    assert err.fields == {} and err.device is None and err.pool is None and err.requested is None
    assert gmp.CallbackReentryError("m", pool="p").pool == "p"


def test_the_fork_refusal_is_made_in_c_as_a_value() -> None:
    """The C side's one error (a forked child cannot run Go), read through
    ctypes: the value Python raises from, and the text C callers get."""
    fork_error = ctypes.CDLL(_native.library_path()).gmp_fork_error
    fork_error.restype = ctypes.c_size_t
    fork_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    n = fork_error(None, 0, 1)
    buf = ctypes.create_string_buffer(n + 1)
    assert fork_error(buf, len(buf), 1) == n
    err = _errors.error_from_value(buf.value.decode())
    assert type(err) is gmp.ForkedProcessError and err.kind == "ForkedProcessError"
    assert str(err) == _native._FORK_MESSAGE and "'spawn'" in str(err)
    text = ctypes.create_string_buffer(2048)
    fork_error(text, len(text), 0)
    assert text.value.decode() == f"ForkedProcessError: {err}"
    short = ctypes.create_string_buffer(8)
    assert fork_error(short, len(short), 0) == len(text.value) and short.value == b"ForkedP"


def test_the_fork_refusal_as_a_value_is_shortened_never_cut() -> None:
    """As the Go side's values (gmp_last_error_value, JSONWithin): a buffer
    too small for the whole value gets its message shortened, so that what
    a forked child's gmp_last_error_value writes still decodes, and the
    length returned is the length written."""
    fork_error = ctypes.CDLL(_native.library_path()).gmp_fork_error
    fork_error.restype = ctypes.c_size_t
    fork_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    for size in (120, 64, 49):
        small = ctypes.create_string_buffer(size)
        n = fork_error(small, len(small), 1)
        assert n == len(small.value) < size, (size, n, small.value)
        err = _errors.error_from_value(small.value.decode())
        assert type(err) is gmp.ForkedProcessError, small.value
        assert _native._FORK_MESSAGE.startswith(str(err).removesuffix("...")), small.value


def _c_abi() -> ctypes.CDLL:
    lib = ctypes.CDLL(_native.library_path())
    lib.gmp_pool_alloc.restype = ctypes.c_void_p
    lib.gmp_pool_alloc.argtypes = [ctypes.c_int64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    for name in ("gmp_last_error", "gmp_last_error_value"):
        getattr(lib, name).restype = ctypes.c_size_t
        getattr(lib, name).argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
    return lib


def test_the_c_abis_last_error_crosses_as_a_value() -> None:
    """gmp_last_error gives C callers the text; gmp_last_error_value the
    same error as its value, with the fields of the Go struct, read through
    ctypes."""
    lib = _c_abi()
    buf = ctypes.create_string_buffer(4096)
    with gmp.MemPool("sim", name="errs", capacity=64 * MiB, limit=4 * MiB) as pool:
        assert not lib.gmp_pool_alloc(pool.handle, 6 * MiB, 0, None)
        n = lib.gmp_last_error_value(pool.handle, buf, len(buf))
        assert n == len(buf.value) > 0
        err = _errors.error_from_value(buf.value.decode())
        assert isinstance(err, gmp.OutOfMemoryError)
        _assert_oom_fields(err, requested=6 * MiB, limit=4 * MiB, where="gmp_pool_alloc: ")
        assert lib.gmp_last_error_value(pool.handle, buf, len(buf)) == 0 and buf.value == b"", "read, it is cleared"
        assert not lib.gmp_pool_alloc(pool.handle, 6 * MiB, 0, None)
        lib.gmp_last_error(pool.handle, buf, len(buf))
        assert buf.value.decode() == str(err), "the text C callers read is the value's message"
        assert not lib.gmp_pool_alloc(pool.handle, 6 * MiB, 0, None)
        small = ctypes.create_string_buffer(120)  # the message is shortened, never the value cut
        assert lib.gmp_last_error_value(pool.handle, small, len(small)) < len(small)
        short = _errors.error_from_value(small.value.decode())
        assert isinstance(short, gmp.OutOfMemoryError) and str(short).endswith("...")
    lib.gmp_last_error_value(0, buf, len(buf))  # no older orphans
    assert not lib.gmp_pool_alloc(10**9, 4096, 0, None)  # a handle no pool has: the orphans' error
    lib.gmp_last_error_value(0, buf, len(buf))
    err = _errors.error_from_value(buf.value.decode())
    assert type(err) is gmp.PoolClosedError and str(err) == f"gmp_pool_alloc: pool handle {10**9}: no such pool"


def _parses_error_text(node: ast.Call) -> bool:
    """A call of re's functions (or a compiled pattern's) on str(<error>)."""
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in ("match", "search", "fullmatch", "findall", "finditer"):
        return False
    for arg in node.args:
        if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "str" and arg.args
                and isinstance(arg.args[0], ast.Name) and arg.args[0].id in ("err", "exc", "e", "error", "ex")):
            return True
    return False


def test_no_module_parses_error_messages() -> None:
    """Fields cross as values: nothing in the package reads an error's
    message with a regular expression (as _OOM_HEAD and the out-of-memory
    snapshot's pool name once did)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_core" in path.parts:
            continue
        source = path.read_text()
        assert "_OOM_HEAD" not in source, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and _parses_error_text(node):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_the_scan_finds_what_it_looks_for() -> None:
    """The check above is no test that cannot fail."""
    tree = ast.parse("import re\nm = re.match(r'pool \"(.*)\"', str(err))\n")
    assert any(isinstance(n, ast.Call) and _parses_error_text(n) for n in ast.walk(tree))
