"""The backends this build provides, from the engine's registry
(``bindings.BackendSchema``), and the check of a backend's options against
it before they go to the engine."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from . import _native
from ._args import check_bool, check_int, device_index
from ._errors import InvalidArgumentError

__all__ = ["BACKENDS", "CALLBACK_OPTIONS", "GPU_OPTIONS", "SIM_OPTIONS", "backend_options", "option_names"]

#: The backends this build provides, by name: what each is (``doc``) and its
#: options (``options``: name, type, bounds, default, doc), from the engine's
#: registry (bindings.BackendSchema). Validation and documentation read it.
BACKENDS: dict[str, dict[str, Any]] = {b["name"]: b for b in json.loads(_native.bindings.BackendSchema())}


def option_names(backend: str) -> tuple[str, ...]:
    """The names of ``backend``'s own options."""
    return tuple(f["name"] for f in BACKENDS[backend]["options"])


#: Options of the simulated device (``backend="sim"``).
SIM_OPTIONS = option_names("sim")
#: Options of the ``callback`` backend (besides ``alloc`` and ``free``).
CALLBACK_OPTIONS = option_names("callback")
#: Options of the GPU backends, which load libcuda (and libnccl) at run time.
GPU_OPTIONS: dict[str, tuple[str, ...]] = {
    name: option_names(name) for name in BACKENDS if name not in ("sim", "callback")
}


def backend_options(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``backend`` for NewPool, checked against its schema:
    the types, and what JSON cannot carry; the engine validates the values
    (in one place) and names the option it refuses."""
    fields = {f["name"]: f for f in BACKENDS[backend]["options"]}
    out: dict[str, Any] = {}
    for key, value in options.items():
        kind = fields[key]["type"]
        if kind == "bool":
            out[key] = check_bool(key, value)
        elif kind in ("path", "string"):
            if not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{key} must be a str, got {type(value).__name__}")
            out[key] = os.fspath(value)
        elif kind == "devices":
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(f"{key} must be a list of device indices")
            out[key] = [device_index(d) for d in value]
        elif kind == "device":
            out[key] = device_index(value)
        elif kind in ("probability", "float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{key} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):  # JSON has no NaN or infinity
                what = "a probability in [0, 1]" if kind == "probability" else "a finite number"
                raise InvalidArgumentError(f"{backend} option {key}={value!r} is not {what}")
            out[key] = float(value)
        else:  # an int within the bounds of its Go type, or narrower
            out[key] = check_int(key, value, int(fields[key]["min"]), int(fields[key]["max"]) + 1)
    return out
