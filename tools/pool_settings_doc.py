"""Write docs/pool-settings.md from the engine's declaration of the pool's
settings (gocore.Config's option tags, via gpumempool._policy). Run it
after adding or changing a setting; tests/test_policy_schema.py fails
until the file matches.

    python tools/pool_settings_doc.py
"""

from __future__ import annotations

from pathlib import Path

from gpumempool._policy import settings_doc

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "docs" / "pool-settings.md"
    out.write_text(settings_doc(), encoding="utf-8")
    print(f"wrote {out}")
