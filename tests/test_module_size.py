"""Each hand-written module of the gpumempool package holds one concept, and
a module past ~700 lines usually holds several: none may be longer than
:data:`LIMIT` lines unless its docstring says why, in a line that starts
"Over 700 lines because" and gives the reason.

Read from the source tree; nothing is imported. The generated code
(gopy's wrappers in gpumempool/_core) is not ours to size.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpumempool"
GENERATED = (PACKAGE / "_core",)
LIMIT = 700
#: A docstring line that lets a module be longer, with its reason.
REASON = re.compile(rf"^\s*Over {LIMIT} lines because \S", re.MULTILINE)
#: Modules exempt for now, with why; each must still exist and be over the
#: limit without a reason (an exemption that no longer applies fails).
EXEMPT: dict[str, str] = {}


def oversized(root: Path, package: Path, generated: tuple[Path, ...]) -> dict[str, int]:
    """The modules under ``package`` longer than LIMIT lines whose docstring
    gives no reason, by path relative to ``root``, with their lengths."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        if any(path.is_relative_to(g) for g in generated):
            continue
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
        if not REASON.search(doc):
            found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_over_the_limit_without_a_reason() -> None:
    found = oversized(ROOT, PACKAGE, GENERATED)
    over = {p: n for p, n in found.items() if p not in EXEMPT}
    assert over == {}, "\n".join(
        f"{p}: {n} lines (split it by concept, or say why not in its docstring: 'Over {LIMIT} lines because ...')"
        for p, n in sorted(over.items()))


def test_each_exemption_still_applies() -> None:
    found = oversized(ROOT, PACKAGE, GENERATED)
    stale = sorted(p for p in EXEMPT if p not in found)
    assert stale == [], f"exempt but no longer over {LIMIT} lines without a reason (drop the exemption): {stale}"


def test_the_check_sees_long_modules_and_their_reasons(tmp_path: Path) -> None:
    """The checks above would pass vacuously if the walk missed modules in
    subpackages or took any docstring for a reason: a made-up package must
    be judged line by line."""
    pkg = tmp_path / "gpumempool"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "_core").mkdir()
    body = "x = 1\n" * LIMIT
    (pkg / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (LIMIT - 1))  # exactly LIMIT lines
    (pkg / "sub" / "long.py").write_text('"""Long, and says nothing about it."""\n' + body)
    (pkg / "reasoned.py").write_text(f'"""One concept.\n\nOver {LIMIT} lines because one table is.\n"""\n' + body)
    (pkg / "mention.py").write_text(f'"""Mentions being over {LIMIT} lines because, but not on a line of its own: '
                                    f'Over {LIMIT} lines because"""\n' + body)
    (pkg / "_core" / "generated.py").write_text(body * 2)
    assert oversized(tmp_path, pkg, (pkg / "_core",)) == {
        "gpumempool/sub/long.py": LIMIT + 1,
        "gpumempool/mention.py": LIMIT + 1,
    }
