"""The pickle scanner (internal/picklescan, through gpumempool._fastcall, or
ctypes in a build without it) and load_pickle: verdicts, reasons and
positions on real, mutated, random and crafted pickles, and the bound on
what a pickle builds."""

from __future__ import annotations

import io
import itertools
import pickle
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from gpumempool import _native, _safepickle
from gpumempool._safepickle import UnsafePickleError, load_pickle

_TESTDATA = Path(__file__).resolve().parents[1] / "internal" / "picklescan" / "testdata"

fast = _native.fastcall
needs_fast = pytest.mark.skipif(fast is None, reason="gpumempool._fastcall is not built")


def _verdict_go(data: bytes, depth: int = _safepickle.MAX_PICKLE_DEPTH) -> Optional[str]:
    assert fast is not None
    res = fast.scan_pickle(data, depth)
    return None if len(res) == 2 else str(_safepickle._scan_error("p", *res))  # type: ignore[misc]


def _verdict_fallback(data: bytes, depth: int = _safepickle.MAX_PICKLE_DEPTH) -> Optional[str]:
    """The verdict of a build without gpumempool._fastcall (ctypes)."""
    saved, _native.fastcall = _native.fastcall, None
    try:
        res = _safepickle._scan(data, depth)
    finally:
        _native.fastcall = saved
    return None if len(res) == 2 else str(_safepickle._scan_error("p", *res))  # type: ignore[misc]


def _seeds() -> list[bytes]:
    frames = [{"filename": f"f{i}.py", "line": i, "name": "fn"} for i in range(6)]
    snap = {
        "segments": [{"address": 1 << 40, "total_size": 2 << 20, "blocks": [
            {"address": 1 << 40, "size": 512, "state": "active_allocated", "frames": frames}]}],
        "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 512, "frames": frames[2:]}] * 3],
        "ids": ((1, 2), ((3, 4), (5, 6)), -1.5, None, True, False, 1 << 100, -(1 << 70), "téxt", b"raw"),
        "sets": [frozenset({"a", "b"}), {"c"}], "ba": bytearray(b"xy"),
    }
    out = [pickle.dumps(snap, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    out += [
        b"\x80\x02}" + b")" + b"\x85" * 120 + b"Ns.",  # deep tuples
        b"(" * 40 + b")" + b"t" * 40 + b".",
        b"\x80\x04}r\x40\x42\x0f\x00.",  # memo index bomb
        b"}p1000000\n.", b"}g5\nh\x00j\x01\x00\x00\x00.", b"}p00012\n.",
        b"\x80\x04\x8c\xff", b"I12\nL5L\nF1.5\nS'a'\nVx\n.",
        b"cbuiltins\nexec\n(Vprint(1)\ntR.",
    ]
    return out


_OPS = [bytes([c]) for c in b"()0122]}\x8f\x88\x89NaseuldtI\x85\x86\x87\x94\x90\x91.\x97\x98"]
#: FRAMEs of 0-9 bytes, one larger than any data here, and one as long as 8 bytes can say.
_FRAMES = [b"\x95" + n.to_bytes(8, "little") for n in (0, 1, 2, 3, 5, 9, 1 << 20, (1 << 64) - 1)]
_ARGS = _FRAMES + [b"h\x00", b"h\x05", b"j\x01\x00\x00\x00", b"q\x00", b"q\x07", b"r\x02\x00\x00\x00",
         b"p0\n", b"p3\n", b"g1\n", b"K\x07", b"M\x01\x02", b"J\x01\x02\x03\x04", b"C\x02ab",
         b"\x8c\x01x", b"X\x01\x00\x00\x00y", b"\x8a\x01\x05", b"\x80\x04", b"\x95" + bytes(8),
         b"I7\n", b"G" + bytes(8)]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        k = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if k == 0 and b:  # flip a byte
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif k == 1:  # cut
            del b[i:]
        elif k == 2:  # insert an opcode
            b[i:i] = rng.choice(_OPS + _ARGS)
        elif k == 3 and b:  # delete a run
            del b[i:i + rng.randint(1, 8)]
        elif k == 4:  # duplicate a run
            b[i:i] = b[i:i + rng.randint(1, 16)]
        else:  # a small number somewhere
            b[i:i] = rng.randrange(256).to_bytes(1, "little")
    return bytes(b)


def _soup(rng: random.Random) -> bytes:
    parts = [rng.choice(_OPS + _ARGS) for _ in range(rng.randint(1, 60))]
    return b"".join(parts) + (b"." if rng.random() < 0.8 else b"")


@needs_fast
def test_mutated_and_random_pickles_meet_every_refusal() -> None:
    """Real pickles mutated, every opcode byte, cuts and opcode soup: the
    scan accepts and refuses a mix of them, for each of its reasons, with
    small nesting limits (the modelled stack) and the real one."""
    rng = random.Random(20261122)
    seeds = _seeds()
    cases = list(seeds) + [bytes([c]) + tail for c in range(256) for tail in (b"", b".", b"\x00" * 9 + b".")]
    cases += [s[:n] for s in seeds[:6] for n in range(0, len(s), 7)]
    cases += [_mutate(rng, rng.choice(seeds)) for _ in range(6000)]
    cases += [_soup(rng) for _ in range(6000)]
    refused = 0
    seen = []
    for i, data in enumerate(cases):
        depth = 3 if i % 2 else _safepickle.MAX_PICKLE_DEPTH  # small limits test the modelled stack
        verdict = _verdict_go(data, depth)
        refused += verdict is not None
        seen.append(verdict or "")
    # The mix exercises both verdicts, and each kind of refusal.
    assert 0.2 < refused / len(cases) < 0.9
    verdicts = "\n".join(seen)
    for why in ("memo index", "tuples nested deeper than 3", "tuples nested deeper than 100", "unknown opcode 0x",
                "a PUT index", "truncated"):
        assert why in verdicts


#: Opcodes that move the modelled stack (tuple nesting, marks, memo).
_STACK_OPS = [b"(", b")", b"0", b"1", b"2", b"t", b"\x85", b"\x86", b"\x87", b"a", b"s", b"e", b"l",
              b"\x94", b"h\x00", b"h\x01", b"h\x02", b"q\x00", b"q\x01", b"]"]


@needs_fast
def test_short_stack_programs() -> None:
    """Every program of up to 3 stack opcodes, and random longer ones, with
    nesting limits of 1 and 2, where a wrongly modelled stack shows: the
    scan refuses a mix of them, and load_pickle loads or refuses each with
    UnsafePickleError, nothing else."""
    rng = random.Random(7)
    programs = [b"".join(p) for n in range(1, 4) for p in itertools.product(_STACK_OPS, repeat=n)]
    programs += [b"".join(rng.choices(_STACK_OPS, k=rng.randint(4, 12))) for _ in range(40000)]
    refused = 0
    for i, prog in enumerate(programs):
        data, depth = prog + b".", 1 + i % 2
        refused += _verdict_go(data, depth) is not None
        try:
            load_pickle(data)
        except UnsafePickleError:
            pass
    assert 0.1 < refused / len(programs) < 0.9


@needs_fast
def test_seed_verdicts() -> None:
    """The seeds' expected verdicts."""
    seeds = _seeds()
    for s in seeds[:6]:
        assert _verdict_go(s) is None
    assert "tuples nested deeper than 100 (opcode 103 at byte 104)" in str(_verdict_go(seeds[6]))
    assert "memo index 1000000 with only 3 opcodes" in str(_verdict_go(seeds[8]))
    assert _verdict_go(b"\x80\x04\x8c\xff") == "p: not a readable pickle: truncated (opcode 2 at byte 3)"
    assert _verdict_go(seeds[-1]) is None  # GLOBAL ends the scan; the unpickler refuses it


@needs_fast
def test_fast_scan_takes_any_bytes_like_object() -> None:
    assert fast is not None
    data = pickle.dumps({"a": [1, 2]})
    for obj in (data, bytearray(data), memoryview(data), memoryview(b"xx" + data)[2:]):
        assert fast.scan_pickle(obj, 100) == (1 + 1 + 1 + 2, 2)  # the dict (1 + 1 key) and its list (1 + 2)
    assert fast.scan_pickle(b"", 100) == (True, "", 0, 0)
    with pytest.raises(TypeError):
        fast.scan_pickle("text", 100)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        fast.scan_pickle(data)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        fast.scan_pickle(data, "deep")  # type: ignore[arg-type]
    for bad in (-1, (1 << 30) + 1):  # a build without the fast path refuses them too
        with pytest.raises(ValueError, match="max_depth"):
            fast.scan_pickle(data, bad)
        with pytest.raises(ValueError, match="max_depth"):
            _verdict_fallback(data, bad)
    with pytest.raises(OverflowError):
        fast.scan_pickle(data, 1 << 64)


def test_load_pickle_without_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build without gpumempool._fastcall scans through ctypes, with the
    same errors."""
    monkeypatch.setattr(_native, "fastcall", None)
    assert load_pickle(pickle.dumps({"x": (1, 2)})) == {"x": (1, 2)}
    with pytest.raises(UnsafePickleError, match=r"memo index 1000000 with only 3 opcodes before it \(opcode 3 at byte 4\)"):
        load_pickle(b"\x80\x04}r\x40\x42\x0f\x00.")
    with pytest.raises(UnsafePickleError, match=r"truncated \(opcode 2 at byte 3\)"):
        load_pickle(b"\x80\x04\x8c\xff")


# -- the shape bound (internal/picklescan/shape.go) ----------------------------


def _exact_shape(root: object) -> Optional[tuple[int, int]]:
    """(nodes, depth) of an unpickled object as _check_structure counts
    them, exactly and without limits (each container 1 + its length, once
    per reference; depth: containers on the longest chain); None for a
    cycle."""
    containers = _safepickle._CONTAINERS
    if type(root) not in containers:
        return (0, 0)
    done: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()

    def walk(obj: Any) -> Optional[tuple[int, int]]:
        if id(obj) in done:
            return done[id(obj)]
        if id(obj) in open_ids:
            return None
        open_ids.add(id(obj))
        nodes, depth = 1 + len(obj), 0
        for child in (list(obj.keys()) + list(obj.values())) if type(obj) is dict else obj:
            if type(child) in containers:
                sub = walk(child)
                if sub is None:
                    return None
                nodes, depth = nodes + sub[0], max(depth, sub[1])
        open_ids.discard(id(obj))
        done[id(obj)] = (nodes, depth + 1)
        return done[id(obj)]

    return walk(root)


def _check_bound(data: bytes) -> str:
    """Whether the Go scan's bound holds for data: "refused", "no bound",
    "unloadable" (bounded, but the unpickler refuses it) or "bounded"."""
    assert fast is not None
    res = fast.scan_pickle(data, _safepickle.MAX_PICKLE_DEPTH)
    if len(res) == 4:
        return "refused"
    nodes, depth = res
    if nodes is None:
        return "no bound"
    try:
        obj = _safepickle._PlainDataUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - whatever the unpickler refuses
        return "unloadable"
    exact = _exact_shape(obj)
    assert exact is not None, f"a bound for a cycle: {data!r}"
    assert exact[0] <= nodes and exact[1] <= depth, (data, exact, res)
    return "bounded"


#: Opcodes that build, fill and share containers.
_SHAPE_OPS = [b"(", b")", b"]", b"}", b"\x8f", b"N", b"K\x01", b"K\x02", b"\x8c\x01k", b"0", b"1", b"2", b"t",
              b"\x85", b"\x86", b"\x87", b"a", b"s", b"e", b"u", b"\x90", b"l", b"d", b"\x91", b"\x94", b"h\x00",
              b"h\x01", b"h\x02", b"q\x00", b"q\x01", *_FRAMES[:6]]


@needs_fast
def test_the_shape_bound_holds_on_every_program_that_loads() -> None:
    """The scan's bound is at least what _check_structure would count, on
    programs that build, fill, share and nest containers (and make cycles,
    which have no bound), on mutated real pickles and on random ones."""
    import collections

    rng = random.Random(11)
    programs = [b"".join(p) + b"." for n in range(1, 4) for p in itertools.product(_SHAPE_OPS, repeat=n)]
    programs += [b"".join(rng.choices(_SHAPE_OPS, k=rng.randint(4, 16))) + b"." for _ in range(60000)]
    seeds = _seeds()
    programs += [_mutate(rng, rng.choice(seeds)) for _ in range(6000)] + [_soup(rng) for _ in range(6000)]
    seen: collections.Counter[str] = collections.Counter()
    for p in programs:
        verdict = _check_bound(p)
        seen[verdict] += 1
        if verdict == "bounded" and (b"h" in p or b"2" in p):
            seen["bounded, sharing"] += 1
    assert seen["bounded"] > 2000 and seen["bounded, sharing"] > 500 and seen["no bound"] > 1000, seen
    # Cycles load, and get no bound.
    for cyclic in (b"]q\x00h\x00a.", b"}q\x00\x8c\x01kh\x00s.", b"]q\x00(h\x00h\x00e.", b"]2a."):
        assert _check_bound(cyclic) == "no bound"
        assert _exact_shape(_safepickle._PlainDataUnpickler(io.BytesIO(cyclic)).load()) is None


def _plain_data(rng: random.Random, depth: int, pool: list[Any]) -> Any:
    """Random plain data, sharing earlier containers from pool."""
    if pool and rng.random() < 0.2:
        return rng.choice(pool)
    k = rng.randrange(8 if depth < 5 else 3)
    if k == 0:
        return rng.randrange(1000)
    if k == 1:
        return f"s{rng.randrange(50)}"
    if k == 2:
        return None
    if k == 3:
        out: Any = [_plain_data(rng, depth + 1, pool) for _ in range(rng.randrange(5))]
    elif k == 4:
        out = {f"k{i}": _plain_data(rng, depth + 1, pool) for i in range(rng.randrange(5))}
    elif k == 5:
        out = tuple(_plain_data(rng, depth + 1, pool) for _ in range(rng.randrange(4)))
    elif k == 6:
        out = {f"e{rng.randrange(100)}" for _ in range(rng.randrange(4))} | {f"e{rng.randrange(9)}".encode()}
    else:
        out = frozenset({f"f{rng.randrange(100)}", None, True})
    pool.append(out)
    return out


@needs_fast
def test_the_shape_bound_is_exact_on_what_pickle_writes() -> None:
    """pickle.dumps of plain data (no dict key or set element written twice)
    gets the exact figures, at every protocol where it is plain opcodes
    (sets and frozensets call code below protocol 4: no bound there)."""
    rng = random.Random(5)
    checked = 0
    for _ in range(1500):
        obj = _plain_data(rng, 0, [])
        exact = _exact_shape(obj)
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            res = fast.scan_pickle(pickle.dumps(obj, protocol=proto), _safepickle.MAX_PICKLE_DEPTH)  # type: ignore[union-attr]
            assert len(res) == 2
            if res[0] is None:
                assert proto < 4, (obj, proto)
                continue
            assert res == exact, (obj, proto)
            checked += 1
    assert checked > 4000
    for name, data in ((p.name, p.read_bytes()) for p in sorted(_TESTDATA.glob("snapshot-p*.pickle"))):
        obj = pickle.loads(data)
        res = fast.scan_pickle(data, _safepickle.MAX_PICKLE_DEPTH)  # type: ignore[union-attr]
        assert res[0] is None or res == _exact_shape(obj), name


@needs_fast
def test_load_pickle_walks_only_what_the_bound_does_not_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[int] = []
    real = _safepickle._check_structure
    monkeypatch.setattr(_safepickle, "_check_structure", lambda obj, name, n: (walked.append(n), real(obj, name, n)))
    snap = {"device_traces": [[{"frames": [{"line": 1}]}] * 100], "segments": []}
    assert load_pickle(pickle.dumps(snap, protocol=4)) == snap
    assert walked == []  # bounded within the budget: nothing to walk
    with pytest.raises(UnsafePickleError, match="cycle"):
        load_pickle(b"]q\x00h\x00a.")  # no bound: walked
    assert len(walked) == 1
    # Shared references beyond the budget: the bound says so, and the walk refuses.
    inner = [0] * 1000
    bomb = pickle.dumps([[inner] * 1000] * 20, protocol=4)
    with pytest.raises(UnsafePickleError, match="shared references"):
        load_pickle(bomb)
    assert len(walked) == 2


# -- opcodes that call code ----------------------------------------------------


@pytest.mark.parametrize("tail", [
    b"}" + b")" + b"\x85" * 200_000 + b"Ns.",  # a tuple 200k deep as a dict key: a crash in CPython
    b"NJ\x00\x00\x00\x00r\xff\xff\xff\x7f.",  # a 2**31 memo index: 32 GiB of memo
    b"]\x94h\x00a.",  # a list that holds itself
], ids=["deep-key", "memo-index", "cycle"])
def test_a_no_op_build_no_longer_hides_the_rest(tail: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: BUILD with a None state is a no-op on any object,
    and the scanners stopped at it as if the unpickler refused it."""
    data = b"\x80\x04]Nb0" + tail
    for fastcall in (_native.fastcall, None):
        monkeypatch.setattr(_native, "fastcall", fastcall)
        with pytest.raises(UnsafePickleError, match="BUILD, an opcode that calls code"):
            load_pickle(data)


def test_ext_from_copyregs_cache_is_refused() -> None:
    """EXT pushes what copyreg's extension cache holds without find_class:
    in a process that once loaded a registered extension code, this
    pickle called os.getcwd."""
    import copyreg

    copyreg.add_extension("os", "getcwd", 0x42)
    try:
        assert pickle.loads(b"\x80\x02\x82\x42.") is __import__("os").getcwd  # fills the cache
        with pytest.raises(UnsafePickleError, match="EXT1, an opcode that calls code"):
            load_pickle(b"\x80\x02\x82\x42)R.")
    finally:
        copyreg.remove_extension("os", "getcwd", 0x42)


# -- memory per byte ------------------------------------------------------------


def test_containers_that_would_take_too_much_memory_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: 10 MB of EMPTY_SET opcodes made the unpickler use
    3.4 GB. The shells of the containers a pickle builds may take 64 bytes
    per byte of pickle, 256 MiB at least; the scan stops at the opcode
    that passes that (with or without the fast path)."""
    sets = 1_300_000  # 1.3 MB of pickle; 216 bytes a set: over 256 MiB at set 1,242,757
    data = b"\x80\x04(" + b"\x8f" * sets + b"l."
    want = (f"p: refused a crafted or corrupt pickle: containers that would take over {256 << 20} bytes to unpickle "
            "(64 per byte of pickle, 256 MiB at least) (opcode 1242759 at byte 1242760)")
    assert _verdict_go(data) == want
    assert _verdict_fallback(data) == want
    assert _verdict_go(b"\x80\x04(" + b"\x8f" * 1_242_756 + b"l.") is None  # the last one that fits
    # Real snapshots build a container per 20-50 bytes: far below the budget.
    snap = {"device_traces": [[{"action": "alloc", "addr": i, "size": 512, "frames": [{"line": i}]}
                               for i in range(200_000)]]}
    assert load_pickle(pickle.dumps(snap, protocol=4)) == snap


def test_tuples_too_costly_to_hash_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: t = (t, t) forty times over () is an 87-byte dict
    key that CPython hashes in 2**41 steps (hours): its hash is not cached.
    The scan counts the work (level k: 2**(k+1) - 1) and stops at the
    tuple that passes 2**20 steps (or one per byte of pickle)."""
    def deep(levels: int) -> bytes:
        return b"\x80\x04})" + b"2\x86" * levels + b"Ns."

    want = ("p: refused a crafted or corrupt pickle: a tuple that would take over 1048576 steps to hash "
            "(shared references inside it) (opcode 43 at byte 44)")
    for levels in (20, 40):
        assert _verdict_go(deep(levels)) == _verdict_fallback(deep(levels)) == want
    for fastcall in (_native.fastcall, None):
        monkeypatch.setattr(_native, "fastcall", fastcall)
        with pytest.raises(UnsafePickleError, match="steps to hash"):
            load_pickle(deep(40))
        # 2**16 - 1 steps (the walk allows 2**20 nodes); in a list, as no tuple may be a dict key
        assert load_pickle(b"\x80\x04])" + b"2\x86" * 15 + b"a.")


def test_keys_whose_hash_a_pickle_can_choose_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: CPython's numeric and tuple hashes are not
    randomized, so a pickle can make every dict key share one hash
    (2**61-1 and its multiples hash to 0) and each insertion compares with
    every earlier key: 60,000 of them (780 KB) took 43 s. Only str and bytes
    (hashed with a random key), None and the bools may be dict keys and set
    elements; snapshots key by str."""
    colliding = b"\x80\x04}(" + b"".join(b"\x8a\x08" + (k * ((1 << 61) - 1)).to_bytes(8, "little") + b"N"
                                         for k in range(1, 5)) + b"u."
    assert len(pickle.loads(colliding)) == 4 and {hash(k) for k in pickle.loads(colliding)} == {0}
    for fastcall in (_native.fastcall, None):
        monkeypatch.setattr(_native, "fastcall", fastcall)
        with pytest.raises(UnsafePickleError, match="not a str or bytes"):
            load_pickle(colliding)
    # Small ints hash to themselves, and crafted ones walk one probe chain of
    # the dict's table (85,000 took 6 s): any int is refused as a key.
    for obj in ({(1, 2): 0}, {1.5: 0}, {frozenset({"a"}): 0}, {1 << 60: 0}, {5: 0}, {(1, 2)}, {7}, frozenset({2.5})):
        assert "not a str or bytes" in str(_verdict_go(pickle.dumps(obj, protocol=4)))
    ok = {"k": (1, 2.5, 1 << 70), b"x": {"x"}, "y": frozenset({b"b", None, True}), "z": [1.5, {"w": 5}]}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(ok, protocol=proto)
        assert _verdict_go(data) == _verdict_fallback(data)
        if proto >= 4:  # below, sets and frozensets call code
            assert load_pickle(data) == ok


# -- frames: the C unpickler reads a file through a frame buffer ---------------


def _smuggle(hidden: bytes) -> bytes:
    """A BINBYTES8 whose 8-byte length starts in a 5-byte frame: the scan
    reads it whole, the C unpickler over a file drops the frame's rest and
    reads a length of 0 from after the frame, then runs ``hidden``."""
    return b"\x80\x04\x95\x05" + bytes(7) + b"\x8e" + (4 + len(hidden)).to_bytes(4, "little") + bytes(8) + hidden + b"N."


@pytest.mark.parametrize("data", [
    _smuggle(b"]q\x00" + b"(h\x00h\x00lq\x00" * 40 + b"."),  # 350 bytes expanding to 2**40 nodes
    _smuggle(b"(" * 5000 + b"]" + b"l" * 5000 + b"."),  # lists 5000 deep
    _smuggle(b"}" + b")" + b"\x85" * 100_000 + b"Ns."),  # a tuple 100k deep as a dict key: a crash in C
    _smuggle(b"Nr\xff\xff\xff\x7f."),  # a 2**31 memo index
    # A length split across a frame's end: BINBYTES reads 0x10, the unpickler a 0 after the frame.
    b"\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00B\x10\x00\x00\x00\x00\x00]q\x00h\x00a.\x00\x00\x00\x00\x00\x00\x00N.",
    # A text GET cut by a frame's end: the unpickler reads "g0" (the list), the scan "g10".
    b"\x80\x04]q\x00N0N0N0N0Nq\n0\x95\x02\x00\x00\x00\x00\x00\x00\x00g10\na.",
], ids=["bomb", "deep-lists", "deep-key", "memo-index", "split-length", "split-line"])
def test_reads_across_a_frames_end_are_refused(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: each of these ran other opcodes than the scanners
    read, past every check (two cycles, a 2**40 expansion, a crash)."""
    with pytest.raises(UnsafePickleError, match="past the end of its frame"):
        load_pickle(data)
    monkeypatch.setattr(_native, "fastcall", None)  # a build without the fast path too
    with pytest.raises(UnsafePickleError, match="past the end of its frame"):
        load_pickle(data)


def test_what_pickle_writes_with_many_frames_loads(tmp_path: Path) -> None:
    """Big pickles, framed (protocols 4, 5) by dumps and by dump to a file,
    whose large payloads go outside frames: no straddle, loaded as is."""
    obj = {"blob": b"x" * 300_000, "text": "y" * 200_000, "more": [b"z" * 70_000, "w" * 70_000],
           "rows": [{"i": i, "name": f"n{i}", "t": (i, str(i))} for i in range(20_000)]}
    for proto in (4, 5):
        data = pickle.dumps(obj, protocol=proto)
        assert data.count(b"\x95") > 3  # framed
        assert load_pickle(data) == obj
        path = tmp_path / f"p{proto}.pickle"
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=proto)
        assert load_pickle(path) == obj
        assert _verdict_fallback(path.read_bytes()) is None


@pytest.mark.parametrize("form", [b" 0", b"+0", b"0_0", b"0 "])
def test_a_get_index_in_another_form_is_refused(form: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C unpickler reads a text GET's index with PyLong_FromString,
    which takes these forms too: a tuple fetched so would nest deeper than
    the scan saw (hashing a deep tuple as a dict key crashes CPython)."""
    deep = b"(" + b")" + b"\x85" * 60 + b"p0\n" + b"g" + form + b"\n" + b"\x85" * 60 + b"t."
    assert pickle.loads(deep)  # the unpickler takes the form
    for fastcall in (_native.fastcall, None):
        monkeypatch.setattr(_native, "fastcall", fastcall)
        with pytest.raises(UnsafePickleError, match="a GET index that is not a small decimal number"):
            load_pickle(deep)
    # In the plain form, the scan sees the 121-deep tuple and refuses it.
    assert "tuples nested deeper than 100" in str(_verdict_go(deep.replace(b"g" + form, b"g0")))


@pytest.mark.parametrize("data, why", [
    (b"\x80\x04\x95\x0a" + bytes(7) + b"\x95\x09" + bytes(7) + b"N.", "a frame that runs past the end of the frame"),
    (b"\x80\x04\x95\x04" + bytes(7) + b"J\x01\x02\x03\x04N.", "an argument that runs past the end of its frame"),
])
def test_frame_refusals_and_positions(data: bytes, why: str) -> None:
    assert why in str(_verdict_fallback(data)) and _verdict_fallback(data) == _verdict_go(data)
    # Ending at the frame's end, or a length whose data starts after it, is fine.
    assert _verdict_go(b"\x80\x04\x95\x05" + bytes(7) + b"J\x01\x02\x03\x04N.") is None
    assert _verdict_go(b"\x80\x04\x95\x01" + bytes(7) + b"C\x02ab.") is None


def _shared_deep_pickle(segments: int, per: int = 99) -> bytes:
    """root = [head_0, ..., head_k-1], where head_i is ``per`` nested lists
    holding head_i-1 innermost: 1 + k*per containers deep, each head first
    reached just below the root."""
    out = bytearray(b"\x80\x04]")
    for i in range(segments):
        out += b"]" * per
        if i:
            out += b"j" + (i - 1).to_bytes(4, "little") + b"a"  # LONG_BINGET head_i-1, into the innermost
        out += b"a" * (per - 1) + b"\x94a"  # close the chain; MEMOIZE head_i (memo i); append it to the root
    return bytes(out + b".")


def test_shared_containers_count_their_height_wherever_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: root = [A, B], A 99 nested lists, B 99 more with A
    innermost. The walk met A first just below the root and, when it met A
    again 100 deep, added A's size but not its height: any depth loaded
    (217,801 from a 14 KB .gz)."""
    data = b"\x80\x04]" + b"]" * 99 + b"a" * 98 + b"\x94a" + b"]" * 99 + b"h\x00" + b"a" * 99 + b"a."
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(_native, "fastcall", None)
        with pytest.raises(UnsafePickleError, match="containers nested deeper than 100"):
            load_pickle(data)
        # Exactly the limit (the root, 50 of B's, 49 of A's) loads.
        ok = b"\x80\x04]" + b"]" * 49 + b"a" * 48 + b"\x94a" + b"]" * 50 + b"h\x00" + b"a" * 50 + b"a."
        assert _exact_shape(load_pickle(ok))[1] == 100  # type: ignore[index]
        deep = _shared_deep_pickle(40)  # 3961 deep, from 8 KB
        assert _exact_shape(pickle.loads(deep))[1] == 1 + 40 * 99  # type: ignore[index]
        with pytest.raises(UnsafePickleError, match="containers nested deeper than 100"):
            load_pickle(deep)
