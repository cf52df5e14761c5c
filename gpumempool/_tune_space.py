"""The search space of :func:`gpumempool.tune.tune`: the values tried for
each setting (torch's and gpumempool's own), their torch option names, which
combinations torch accepts, and the ``PYTORCH_CUDA_ALLOC_CONF`` line of a
setting."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Union

from ._errors import InvalidArgumentError
from ._policy import SETTINGS, TORCH_SIZES, torch_settings

__all__ = ["COARSE", "EXTRA_SPACE", "MiB", "OPTION_NAMES", "SETTING_KEYS", "TORCH_NAMES", "TORCH_SPACE", "alloc_conf",
           "clean_settings", "excluded_keys", "settings_key", "torch_expressible"]

MiB = 1 << 20


#: The values tried for each setting torch's allocator accepts (replay
#: policy keys; ``None`` is torch's default): expandable segments, then the
#: pool settings torch has, with the values the engine's schema says are
#: worth trying (``search``). torch refuses ``max_split_size_mb`` of 20 or
#: less and ``roundup_power2_divisions`` that are not powers of two;
#: ``garbage_collection_threshold`` is a fraction of the memory torch may
#: use, so it is tried only with a limit.
TORCH_SPACE: dict[str, list[Any]] = {
    "expandable": [False, True],
    **{key: [None, *SETTINGS[key].get("search", [])] for key in torch_settings()},
}


#: Values only gpumempool's pools accept (the settings torch has not),
#: tried from the best torch setting.
EXTRA_SPACE: dict[str, list[Any]] = {
    f["name"]: list(f["search"]) for f in SETTINGS.values() if f.get("search") and not f.get("torch")
}


#: The coarse grid the search starts from.
COARSE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "roundup_power2_divisions": [None, 2, 8],
    "max_split_size": [None, 64 * MiB, 512 * MiB],
}


#: torch's PYTORCH_CUDA_ALLOC_CONF names of the replay policy keys, in
#: torch's documented order: expandable segments (a backend's option, not a
#: pool setting), then the pool settings torch has too (the engine's schema).
TORCH_NAMES = {"expandable": "expandable_segments", **torch_settings()}


SETTING_KEYS = tuple(dict.fromkeys([*TORCH_SPACE, *EXTRA_SPACE]))


#: The names ``exclude`` accepts: torch's option names and the replay
#: policy keys, each to the policy key it drops from the search.
OPTION_NAMES: dict[str, str] = {**{name: key for key, name in TORCH_NAMES.items()},
                                **{key: key for key in SETTING_KEYS}}


def torch_expressible(settings: Mapping[str, Any]) -> bool:
    """Whether torch's allocator accepts ``settings``."""
    for key, value in settings.items():
        if key not in TORCH_NAMES:
            return False
        field = SETTINGS.get(key, {})
        scale, least = field.get("torch_scale"), int(field.get("torch_min", 0))
        if scale and (value % scale or value // scale < least):  # torch reads whole MiB, from its minimum
            return False
        if key == "roundup_power2_divisions" and not _divisions_ok(value):
            return False
    return True


def _divisions_ok(value: Any) -> bool:
    """A count torch accepts for roundup_power2_divisions (a power of two),
    or one per size interval (a power of two or 0 each, as torch's
    ``[1:n,2:n,...]`` form takes them)."""
    if isinstance(value, (list, tuple)):
        return len(value) == TORCH_SIZES["roundup_intervals"] and all(_divisions_ok(v) or v == 0 for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1)


def alloc_conf(settings: Mapping[str, Any]) -> str:
    """Replay policy keys torch accepts as torch's ``key:value,...`` setting
    ("" for its defaults), in torch's documented order."""
    parts = []
    for key, value in sorted(settings.items(), key=lambda kv: list(TORCH_NAMES).index(kv[0])):
        name = TORCH_NAMES[key]
        if key == "expandable":
            parts.append(f"{name}:True")
        elif SETTINGS.get(key, {}).get("torch_scale"):
            parts.append(f"{name}:{value // SETTINGS[key]['torch_scale']}")
        elif isinstance(value, (list, tuple)):
            # per size interval, keyed by its first size in MiB as torch reads them
            parts.append(f"{name}:[" + ",".join(f"{1 << i}:{v}" for i, v in enumerate(value)) + "]")
        else:
            parts.append(f"{name}:{value}")
    return ",".join(parts)


def settings_key(settings: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in settings.items() if v is not None and v is not False))


def clean_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without the defaults, and without the settings that do
    nothing in that company (torch ignores max_non_split_rounding_mb
    without max_split_size_mb)."""
    # per-interval divisions as a tuple: settings are keys of the replays done
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if v is not None and v is not False}
    if "max_non_split_rounding_size" in out and "max_split_size" not in out:
        del out["max_non_split_rounding_size"]
    return out


def excluded_keys(exclude: Union[str, Iterable[str], None]) -> list[str]:
    """The policy keys of ``exclude`` (torch's option names or policy keys;
    a string may list several, comma-separated)."""
    if exclude is None:
        return []
    names = [exclude] if isinstance(exclude, str) else list(exclude)
    keys: list[str] = []
    for item in names:
        if not isinstance(item, str):
            raise InvalidArgumentError(f"exclude takes option names, got {item!r}")
        for name in (n.strip() for n in item.split(",")):
            if not name:
                continue
            if name not in OPTION_NAMES:
                raise InvalidArgumentError(f"exclude: unknown option {name!r}; valid: {', '.join(OPTION_NAMES)}")
            keys.append(OPTION_NAMES[name])
    return list(dict.fromkeys(keys))
