"""The search space of :func:`gpumempool.tune.tune`: the values tried for
each setting (torch's and gpumempool's own), their torch option names, which
combinations torch accepts, and the ``PYTORCH_CUDA_ALLOC_CONF`` line of a
setting."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Union

from ._errors import InvalidArgumentError

__all__ = ["COARSE", "EXTRA_SPACE", "MiB", "OPTION_NAMES", "SETTING_KEYS", "TORCH_NAMES", "TORCH_SPACE", "alloc_conf",
           "clean_settings", "excluded_keys", "settings_key", "torch_expressible"]

MiB = 1 << 20


#: The values tried for each setting torch's allocator accepts (replay
#: policy keys; ``None`` is torch's default). torch refuses
#: ``max_split_size_mb`` of 20 or less and ``roundup_power2_divisions`` that
#: are not powers of two; ``garbage_collection_threshold`` is a fraction of
#: the memory torch may use, so it is tried only with a limit.
TORCH_SPACE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "max_split_size": [None, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB, 1024 * MiB, 2048 * MiB],
    "roundup_power2_divisions": [None, 1, 2, 4, 8, 16],
    "max_non_split_rounding_size": [None, 64 * MiB, 256 * MiB, 1024 * MiB],
    "garbage_collection_threshold": [None, 0.5, 0.6, 0.7, 0.8, 0.9],
}


#: Values only gpumempool's pools accept, tried from the best torch setting.
EXTRA_SPACE: dict[str, list[Any]] = {
    "release_threshold": [64 * MiB, 256 * MiB, 1024 * MiB],
}


#: The coarse grid the search starts from.
COARSE: dict[str, list[Any]] = {
    "expandable": [False, True],
    "roundup_power2_divisions": [None, 2, 8],
    "max_split_size": [None, 64 * MiB, 512 * MiB],
}


#: torch's PYTORCH_CUDA_ALLOC_CONF names of the replay policy keys.
TORCH_NAMES = {
    "expandable": "expandable_segments",
    "max_split_size": "max_split_size_mb",
    "roundup_power2_divisions": "roundup_power2_divisions",
    "max_non_split_rounding_size": "max_non_split_rounding_mb",
    "garbage_collection_threshold": "garbage_collection_threshold",
}


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
        if key in ("max_split_size", "max_non_split_rounding_size") and (value % MiB or value <= 20 * MiB):
            return False
        if key == "roundup_power2_divisions" and not _divisions_ok(value):
            return False
    return True


def _divisions_ok(value: Any) -> bool:
    """A count torch accepts for roundup_power2_divisions (a power of two),
    or one per size interval (a power of two or 0 each, as torch's
    ``[1:n,2:n,...]`` form takes them)."""
    if isinstance(value, (list, tuple)):
        return len(value) == 16 and all(_divisions_ok(v) or v == 0 for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1)


def alloc_conf(settings: Mapping[str, Any]) -> str:
    """Replay policy keys torch accepts as torch's ``key:value,...`` setting
    ("" for its defaults), in torch's documented order."""
    parts = []
    for key, value in sorted(settings.items(), key=lambda kv: list(TORCH_NAMES).index(kv[0])):
        name = TORCH_NAMES[key]
        if key == "expandable":
            parts.append(f"{name}:True")
        elif key in ("max_split_size", "max_non_split_rounding_size"):
            parts.append(f"{name}:{value // MiB}")
        elif key == "roundup_power2_divisions" and isinstance(value, (list, tuple)):
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
