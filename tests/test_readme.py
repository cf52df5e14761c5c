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
