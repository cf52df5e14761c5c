"""Checks and conversions of the arguments the package's functions take:
integers in a range, real bools, devices, streams, torch's
``roundup_power2_divisions``. One copy, imported by every module that takes
such arguments (MemPool, cache scopes, CuPy, traces); of the package it
imports only the errors, the extension (for the engine's device bound) and
the pool's settings as the engine declares them (_policy)."""

from __future__ import annotations

from typing import Any, Mapping

from . import _native
from ._errors import InvalidArgumentError
from ._policy import LIST_FORMS, SETTINGS, TORCH_SIZES

__all__ = [
    "I64",
    "MAX_DEVICE",
    "ROUNDUP_INTERVALS",
    "U64",
    "as_stream",
    "check_bool",
    "check_int",
    "check_settings",
    "device_index",
    "roundup_option",
]

#: Exclusive bounds of the engine's unsigned and signed 64-bit integers.
U64 = 1 << 64
I64 = 1 << 63
#: Exclusive bound of a device index: the engine's (gocore.MaxDevices), the
#: one bound on a pool's devices, a trace's and a snapshot's.
MAX_DEVICE: int = _native.bindings.MaxDevices()
#: Size intervals of torch's per-size roundup_power2_divisions.
ROUNDUP_INTERVALS: int = TORCH_SIZES["roundup_intervals"]
#: The one setting that takes a count per size interval too (torch's
#: roundup_power2_divisions), and the setting the engine reads the list as.
_DIVISIONS, _DIVISIONS_BY_SIZE = next(iter(LIST_FORMS.items()))


def check_bool(name: str, value: Any) -> bool:
    """A real bool: an option read by truthiness would turn ``"false"`` or
    ``"no"`` on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {repr(value)[:40]}")
    return value


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` when it is an int (not a bool) in ``[lo, hi)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value < hi:
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi}), got {value}")
    return value


def roundup_option(value: Any) -> dict[str, Any]:
    """The NewPool JSON for ``roundup_power2_divisions``: one count for every
    size, or one per size interval (a sequence, or torch's snapshot dict
    keyed "1".."16")."""
    name = _DIVISIONS
    if isinstance(value, Mapping):
        keys = {str(i) for i in range(1, ROUNDUP_INTERVALS + 1)}
        if set(map(str, value)) != keys:
            raise InvalidArgumentError(f"{name} as a dict needs the keys '1'..'{ROUNDUP_INTERVALS}', got {sorted(value)}")
        value = [value[k] if k in value else value[int(k)] for k in sorted(keys, key=int)]
    if isinstance(value, (list, tuple)):
        if len(value) != ROUNDUP_INTERVALS:
            raise InvalidArgumentError(f"{name} per size needs {ROUNDUP_INTERVALS} counts, got {len(value)}")
        return {_DIVISIONS_BY_SIZE: [check_int(f"{name}[{i}]", v, 0, U64) for i, v in enumerate(value)]}
    return {name: check_int(name, value, 0, U64)}


def check_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The NewPool JSON of the pool settings given (a value of None is left
    out), each checked by its type and unit in the engine's schema: ints
    within their bounds, fractions in [0, 1), strings; a setting with a list
    form (:func:`roundup_option`) as one value or the list. The engine
    checks what the schema cannot say (a max_split_size of at least 20
    MiB, divisions that are powers of two)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        field = SETTINGS[name]
        if name in LIST_FORMS:
            out.update(roundup_option(value))
        elif field["type"] == "int":
            out[name] = check_int(name, value, int(field["min"]), int(field["max"]) + 1)
        elif field.get("unit") == "fraction":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not 0 <= value < 1:  # NaN too
                raise InvalidArgumentError(f"{name} must be in [0, 1), got {value!r}")
            out[name] = float(value)
        elif field["type"] == "string":
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
            out[name] = value
        else:  # a type this function has not learned: a new kind of setting
            raise NotImplementedError(f"setting {name} of type {field['type']} has no check")
    return out


def as_stream(stream: Any) -> int:
    """A stream handle as an int: an int, None (the default stream), or an
    object with ``cuda_stream`` (torch.cuda.Stream) or ``ptr`` (cupy)."""
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):
        if not isinstance(stream, int) and hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    return check_int("stream", stream, 0, U64)


def device_index(device: Any) -> int:
    """0, 1, ... or "cuda:1" / torch.device("cuda", 1)."""
    if isinstance(device, str):
        head, _, idx = device.partition(":")
        if head not in ("cuda", "sim", "") or (idx and not (idx.isascii() and idx.isdigit())) or len(idx) > 7:
            raise InvalidArgumentError(f"device must be an int or 'cuda:N', got {device[:40]!r}")
        return check_int("device", int(idx), 0, MAX_DEVICE) if idx else 0
    if hasattr(device, "index") and hasattr(device, "type"):
        kind = device.type
        if not isinstance(kind, str) or kind not in ("cuda", "sim"):
            shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
            raise InvalidArgumentError(f"device must be a CUDA device, got a device of type {shown!r}")
        return 0 if device.index is None else check_int("device.index", device.index, 0, MAX_DEVICE)
    return check_int("device", device, 0, MAX_DEVICE)
