"""Find the installed gpumempool when Python imports a source checkout.

``pip install .`` puts the built extension in site-packages, but running
``python -m gpumempool`` from the root of the checkout makes Python import
the checkout's ``gpumempool/`` first, which has no extension (``_core``). In
that case, and only then, the installed copy is loaded in its place, so the
README's commands work from the clone. An editable install (``pip install
-e .``) builds ``_core`` into the checkout and is used as it is.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

def installed_copy(here: Path) -> Optional[Path]:
    """The directory of another gpumempool package on sys.path that has its
    extension built, or None when the package at ``here`` has it (or none
    has)."""
    here = here.resolve()
    if (here / "_core").is_dir():
        return None
    for entry in sys.path:
        try:
            cand = (Path(entry or ".") / "gpumempool").resolve()
        except OSError:
            continue
        if cand != here and (cand / "_core").is_dir() and (cand / "__init__.py").is_file():
            return cand
    return None


def load_installed(name: str, init_file: str) -> Optional[ModuleType]:
    """Import the installed copy as module ``name`` (replacing the package
    whose ``__init__.py`` is ``init_file`` in sys.modules); None when there
    is nothing better to load. The path is passed in rather than taken from
    this module because the installed copy may run this very module object."""
    where = installed_copy(Path(init_file).parent)
    if where is None:
        return None
    spec = importlib.util.spec_from_file_location(name, where / "__init__.py", submodule_search_locations=[str(where)])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
