"""README's examples that need no GPU run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_sim_examples_in_readme_run(capsys) -> None:
    # code lines only: comments may mention torch
    runnable = [b for b in python_blocks()
                if 'backend="sim"' in b and "torch" not in "\n".join(ln.split("#")[0] for ln in b.splitlines())]
    assert runnable, "README lost its sim example"
    for block in runnable:
        exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out.split()
    assert out[:2] == ["1024", "2097152"]  # peak allocated and reserved of the first example


def _cpu_results() -> str:
    return (README.parent / "benchmarks" / "results" / "cpu.md").read_text()


def _table_row(text: str, label: str) -> list[str]:
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {label}"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_readme_prose_quotes_its_benchmark_tables() -> None:
    """The prose said 'about 150 MB/s' next to a table of 101 MB/s, and that
    a safe load costs 'about the same as pickle.loads' (0.367 s vs 0.240 s)."""
    text = " ".join(README.read_text().split())
    cpu = _cpu_results()
    scan = float(_table_row(cpu, "opcode scan in Go")[2])
    quoted = float(re.search(r"in Go \(`bindings/picklescan`, without the GIL\) at about (\d+) MB/s", text).group(1))
    assert abs(quoted - scan) <= 0.1 * scan, (quoted, scan)
    safe = float(_table_row(cpu, "load_pickle, Go scan")[1])
    plain = float(_table_row(cpu, "plain pickle.loads")[1])
    python = float(_table_row(cpu, "load_pickle, Python scan")[1])
    m = re.search(r"a safe load of a 9.6 MB snapshot takes about ([\d.]+)× as long as a plain `pickle.loads` "
                  r"\(([\d.]+) s against ([\d.]+) s;.*?with the Python scan and the walk \(([\d.]+) s\)", text)
    assert m, "README's safe-load sentence changed"
    assert abs(float(m.group(1)) - safe / plain) < 0.1
    assert (float(m.group(2)), float(m.group(3)), float(m.group(4))) == (round(safe, 2), round(plain, 2), round(python, 1))


def test_readme_says_what_a_size_0_c_abi_allocation_does() -> None:
    """It said NULL 'with the message in pool.last_error()', which stays None
    for torch's entry points (tests/test_cabi.py checks both)."""
    rows = [ln for ln in README.read_text().splitlines() if ln.startswith("|") and "size 0" in ln]
    assert any("gmp_alloc_<i>" in r and "no error" in r for r in rows), rows
    assert not any(r.startswith("| C ABI: size 0,") for r in rows)


def _own_allocator_blocks() -> tuple[str, str]:
    c_block = next(b for b in python_blocks() if "libmyalloc.so" in b)
    py_block = next(b for b in python_blocks() if "def my_alloc" in b)
    return c_block, py_block


def test_the_own_allocator_examples_in_readme_run(clib, capsys) -> None:
    """The 'Your own allocator' block had no imports and names that were
    never defined: the Python variant runs as written, the C one with the
    tests' C allocator (tests/csrc/testalloc.c) for its placeholders."""
    c_block, py_block = _own_allocator_blocks()
    exec(compile(py_block, str(README), "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.split() == ["2097152", "0"]
    clib.test_reset(-1)
    c_block = (c_block.replace('"libmyalloc.so"', repr(clib._name))
               .replace("my_alloc", "test_alloc").replace("my_free", "test_free"))
    exec(compile(c_block, str(README), "exec"), {"__name__": "readme_example"})
    assert clib.test_allocs() == 2 and clib.test_frees() == 2 and clib.test_live_bytes() == 0
