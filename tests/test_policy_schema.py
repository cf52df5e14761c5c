"""The pool's settings are declared once, by the engine (gocore.Config's
option tags, published by bindings.PoolSchema), and every layer above is
built from that declaration: MemPool's checks and doc, replay's policy
keys, tune's torch names and validity rules, the oracle's alloc-conf
reader, and docs/pool-settings.md.

Two proofs that adding a setting is one struct field (plus the engine code
that reads it, and its tests): a setting added to the published schema
reaches every Python layer with no edit (the Go half, that a tagged field
is decoded and reported back by the bindings with no edit, is
bindings/policy_test.go's TestEverySettingCrossesBothWays); and no
hand-written source but the declaration names the settings, except the
listed places where code acts on one particular setting."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpumempool as gmp
from gpumempool import _policy
from gpumempool.replay import POLICY_KEYS
from gpumempool.tune import EXTRA_SPACE, TORCH_NAMES, TORCH_SPACE

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
needs_checkout = pytest.mark.skipif(not (ROOT / "go.mod").is_file(), reason="needs the source checkout")


def test_the_docs_table_is_the_engines() -> None:
    doc = ROOT / "docs" / "pool-settings.md"
    assert doc.read_text(encoding="utf-8") == _policy.settings_doc(), \
        "docs/pool-settings.md is stale: run python tools/pool_settings_doc.py"
    for name in _policy.ARGUMENTS:
        assert f"| `{name}` |" in doc.read_text(encoding="utf-8")


def test_mempools_setting_parameters_are_the_schemas() -> None:
    """The typed keyword arguments of MemPool besides its own are the
    schema's settings, each defaulting to None (left out); a setting added
    to the engine without a parameter yet is taken among ``**options``
    (see test_a_setting_added_to_the_engines_schema_reaches_every_layer)."""
    own = {"self", "backend", "alloc", "free", "name", "device", "options"}
    params = [p for p in inspect.signature(gmp.MemPool.__init__).parameters.values() if p.name not in own]
    assert {p.name for p in params} == set(_policy.ARGUMENTS)
    assert all(p.default is None and p.kind is p.KEYWORD_ONLY for p in params)


def test_replay_and_tune_keys_come_from_the_schema() -> None:
    settings = [a for a in _policy.ARGUMENTS if _policy.SETTINGS[a]["unit"] != "version"]
    assert list(POLICY_KEYS)[:len(settings)] == settings
    assert list(POLICY_KEYS)[len(settings):] == ["expandable", "granularity", "capacity"]
    # what leaving a key out gives, where 0 does not say it (the CLI's
    # replay help said "default 20 MiB" before the schema)
    assert "; default 20 MiB" in POLICY_KEYS["max_non_split_rounding_size"]
    assert {k: v for k, v in TORCH_NAMES.items() if k != "expandable"} == _policy.torch_settings()
    # tune searches the values the schema lists: torch's settings from their
    # default, the engine's own from the best torch setting
    assert TORCH_SPACE == {
        "expandable": [False, True],
        "max_split_size": [None, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB, 1024 * MiB, 2048 * MiB],
        "roundup_power2_divisions": [None, 1, 2, 4, 8, 16],
        "max_non_split_rounding_size": [None, 64 * MiB, 256 * MiB, 1024 * MiB],
        "garbage_collection_threshold": [None, 0.5, 0.6, 0.7, 0.8, 0.9],
    }
    assert EXTRA_SPACE == {"release_threshold": [64 * MiB, 256 * MiB, 1024 * MiB]}


def test_torch_sizes_are_the_engines() -> None:
    from gpumempool import _start_state

    sizes = _policy.TORCH_SIZES
    assert (_start_state.SMALL_SIZE, _start_state.SMALL_BUFFER, _start_state.MIN_BLOCK) == (1 << 20, 2 << 20, 512)
    assert _start_state.DEFAULT_NON_SPLIT_ROUNDING == sizes["large_buffer"] == 20 * MiB
    # the default the engine fills in is the size published
    with gmp.MemPool() as pool:
        assert pool.config()["max_non_split_rounding_size"] == sizes["large_buffer"]


#: A setting the engine does not have: published as if gocore.Config had
#: one more tagged field.
NEW_SETTING = {"name": "spare_size", "type": "int", "min": 0, "max": (1 << 64) - 1, "unit": "bytes",
               "torch": "spare_size_mb", "torch_unit": "MiB", "torch_scale": MiB, "torch_min": 4,
               "search": [8 * MiB], "doc": "bytes kept spare per device"}

ADDED = r"""
import importlib, json, sys
from gpumempool import _native
published = json.loads(_native.bindings.PoolSchema())
_native.bindings.PoolSchema = lambda: json.dumps(published + [json.loads(sys.argv[1])])

# the layers as they are built at import, from the schema now published
from gpumempool import _args, _policy, _pool, _tune_space, _tune_result, _tune_run, replay, tune
from gpumempool.oracle import fidelity
for module in (_policy, _args, _pool, replay, _tune_space, _tune_result, _tune_run, tune, fidelity):
    importlib.reload(module)
gmp = _pool

def error(**kwargs):
    try:
        gmp.MemPool(**kwargs).close()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {exc}"
    return None

MiB = 1 << 20
print(json.dumps({
    "doc": "``spare_size``: bytes kept spare per device" in gmp.MemPool.__doc__,
    "valid": error(bogus=1),
    "type": error(spare_size="8MiB"),
    "range": error(spare_size=-1),
    "engine": error(spare_size=8 * MiB),
    "policy_keys": "spare_size" in replay.POLICY_KEYS,
    "parsed": replay.parse_policy("spare_size=8MiB"),
    "torch_name": tune.TORCH_NAMES.get("spare_size"),
    "alloc_conf": tune.alloc_conf({"spare_size": 8 * MiB}),
    "torch_accepts": [_tune_space.torch_expressible({"spare_size": v}) for v in (2 * MiB, 8 * MiB, 8 * MiB + 1)],
    "exclude": tune.OPTION_NAMES.get("spare_size_mb"),
    "searched": tune.TORCH_SPACE.get("spare_size"),
    "oracle": fidelity.parse_alloc_conf("spare_size_mb:8"),
    "table": "| `spare_size` | bytes | 0 | `spare_size_mb` (in MiB) | bytes kept spare per device |"
             in _policy.settings_table(),
}))
"""


def test_a_setting_added_to_the_engines_schema_reaches_every_layer() -> None:
    """No Python edit: the new setting is documented, checked by its type
    and unit, passed to the engine (which, not having it, refuses it by
    name), a replay policy key, a torch setting tune writes in MiB and
    judges by torch's minimum, read from torch's alloc conf by the oracle,
    and a row of the docs table."""
    p = subprocess.run([sys.executable, "-c", ADDED, json.dumps(NEW_SETTING)], capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["doc"]
    assert "valid: name, limit, " in got["valid"] and ", spare_size, " in got["valid"]
    assert got["type"] == "TypeError: spare_size must be an int, got str"
    assert got["range"] == "InvalidArgumentError: spare_size must be in [0, 18446744073709551616), got -1"
    assert got["engine"].startswith("InvalidArgumentError: pool options: ") and '"spare_size"' in got["engine"]
    assert got["policy_keys"] and got["parsed"] == {"spare_size": 8 * MiB}
    assert got["torch_name"] == "spare_size_mb" and got["alloc_conf"] == "spare_size_mb:8"
    assert got["torch_accepts"] == [False, True, False]
    assert got["exclude"] == "spare_size" and got["searched"] == [None, 8 * MiB]
    assert got["oracle"] == {"spare_size": 8 * MiB}
    assert got["table"]


#: The hand-written places besides the declaration (gocore/pool.go's
#: option tags) that name a setting (or torch's name of it) in a string
#: literal, and why. None lists the settings: each acts on particular ones.
NAMED_BY_HAND: dict[str, tuple[set[str], str]] = {
    "gpumempool/_cli/replay.py": ({"limit"}, "replay's report shows the limit the replay ran under"),
    "gpumempool/_errors.py": ({"limit"}, "OutOfMemoryError's limit field, the one the engine's error carries"),
    "gpumempool/_oom_snapshot.py": ({"limit"}, "an OOM snapshot takes the device's size from the limit"),
    "gpumempool/_pool.py": ({"limit"}, "set_limit's own argument"),
    "gpumempool/_start_state.py": ({"max_split_size", "max_non_split_rounding_size", "roundup_power2_divisions"},
                                   "rebuilds torch's blocks by those settings' rules"),
    "gpumempool/oracle/fidelity.py": ({"garbage_collection_threshold", "torch_version"},
                                      "the threshold applies only with a limit; the version picks the rules"),
    "gpumempool/oracle/verify.py": ({"garbage_collection_threshold"}, "an alloc conf with it needs a fraction"),
    "gpumempool/replay.py": ({"garbage_collection_threshold", "limit"},
                             "the warning for a threshold without a limit; a fraction becomes a limit"),
    "gpumempool/trace/_policy.py": ({"garbage_collection_threshold", "max_non_split_rounding_size",
                                     "max_split_size", "roundup_power2_divisions", "roundup_power2_divisions_by_size"},
                                    "torch_allocator_policy reads torch's snapshot keys; describe_pool leaves out "
                                    "the non-split rounding the engine fills in"),
    "gpumempool/tune.py": ({"garbage_collection_threshold"}, "the threshold is searched only with a limit"),
    "gpumempool/_tune_space.py": ({"max_non_split_rounding_size", "max_split_size", "roundup_power2_divisions"},
                                  "its coarse first grid; torch's rules (divisions are powers of two, "
                                  "non-split rounding needs max_split_size)"),
    "gpumempool/_tune_result.py": ({"limit", "torch_version"}, "TuneResult's own limit and torch_version fields"),
    "gpumempool/_tune_run.py": ({"limit"}, "a candidate runs under the limit tune was given"),
    "gocore/stats.go": ({"max_split_size"}, "torch's memory_stats key of the same name, a statistic"),
    "bindings/pyerr/pyerr.go": ({"limit"}, "an out-of-memory error's limit field"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


@needs_checkout
def test_only_the_declaration_names_the_settings() -> None:
    names = set(_policy.SETTINGS) | {f["torch"] for f in _policy.SCHEMA if f.get("torch")}
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "gpumempool").rglob("*.py")):
        if "_core" in path.relative_to(ROOT).parts:  # gopy's generated wrappers
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        hits = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                and isinstance(node.value, str) and node.value in names and id(node) not in docs}
        if hits:
            found[path.relative_to(ROOT).as_posix()] = hits
    for folder in ("gocore", "bindings"):
        for path in sorted((ROOT / folder).rglob("*.go")):
            rel = path.relative_to(ROOT)
            if path.name.endswith("_test.go") or any(part.startswith("_gopy") for part in rel.parts):
                continue
            hits = set(re.findall(r'"((?:[^"\\\n]|\\.)*)"', path.read_text(encoding="utf-8"))) & names
            if hits:
                found[rel.as_posix()] = hits
    declaration = found.pop("gocore/pool.go")
    assert declaration == names, "gocore.Config's tags declare every setting and torch name"
    assert found == {path: listed for path, (listed, _) in NAMED_BY_HAND.items()}
