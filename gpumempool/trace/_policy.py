"""The allocator policy a recording names: torch's ``allocator_settings``
as replay's policy keys, and the recording pool's own."""

from __future__ import annotations

import re
from typing import Any

from .._policy import ARGUMENTS, LIST_FORMS, SETTINGS, TORCH_SIZES
from ._trace import Trace

__all__ = ["describe_pool", "torch_allocator_policy"]


def torch_allocator_policy(settings: Any) -> dict[str, Any]:
    """The replay policy (keys of :data:`gpumempool.replay.POLICY_KEYS`)
    equivalent to a torch snapshot's ``allocator_settings`` (torch >= 2.1):
    max_split_size (torch writes -1 for unlimited), expandable_segments,
    garbage_collection_threshold (it acts only under a limit, which the
    snapshot does not record: pass the memory fraction as ``limit``) and
    roundup_power2_divisions (per size interval, "1".."16"). Settings we do
    not model are left out; defaults are not listed."""
    if not isinstance(settings, dict):
        return {}
    out: dict[str, Any] = {}
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and not isinstance(mss, bool) and 0 < mss < (1 << 62):
        out["max_split_size"] = mss
    if settings.get("expandable_segments") is True:
        out["expandable"] = True
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool) and 0 < gc < 1:
        out["garbage_collection_threshold"] = float(gc)
    div = settings.get("roundup_power2_divisions")
    if isinstance(div, dict):
        from .._args import ROUNDUP_INTERVALS, roundup_option

        starts = [str(1 << i) for i in range(ROUNDUP_INTERVALS)]
        if set(map(str, div)) == set(starts):
            # torch writes the intervals by their first size in MiB ("1", "2", "4", ... "32768")
            div = [div[k] if k in div else div[int(k)] for k in starts]
        try:
            vals = roundup_option(div)["roundup_power2_divisions_by_size"]
        except (ValueError, TypeError):  # not torch's 16 intervals of counts
            vals = []
        if any(v > 1 for v in vals):
            out["roundup_power2_divisions"] = vals[0] if len(set(vals)) == 1 else vals
    # max_non_split_rounding_mb has no field of its own: only the setting string says it
    for key, conf in settings.items():
        if isinstance(key, str) and key.endswith("ALLOC_CONF") and isinstance(conf, str):
            m = re.search(r"(?:^|,)\s*max_non_split_rounding_mb\s*:\s*(\d{1,9})\s*(?:,|$)", conf)
            if m and int(m.group(1)) > 20:
                out["max_non_split_rounding_size"] = int(m.group(1)) << 20
    return out


#: The settings a recorded policy keeps: the pool's, as the engine declares
#: them, but the torch version (it picks rules; it is not a policy key).
_RECORDED = tuple(key for key in ARGUMENTS if SETTINGS[key].get("unit") != "version")
#: The values the engine fills in for a setting left out (torch's 20 MiB
#: non-split rounding), left out of recorded policies like the other defaults.
_FILLED_IN = {"max_non_split_rounding_size": TORCH_SIZES["large_buffer"]}


def describe_pool(tr: Trace, pool: Any) -> None:
    """Name and policy of the recording pool, for the reader of the trace:
    its backend and the settings it does not leave at their defaults (a
    setting given per size interval as its list)."""
    try:
        cfg = pool.config()
    except Exception:  # a closed pool, or a stand-in without config()
        return
    tr.meta["pool"] = cfg.get("name")
    pol = {"backend": cfg["backend"]} if cfg.get("backend") else {}
    for key in _RECORDED:
        value = cfg.get(LIST_FORMS[key]) if key in LIST_FORMS and cfg.get(LIST_FORMS[key]) else cfg.get(key)
        if value and value != _FILLED_IN.get(key):
            pol[key] = value
    tr.meta["recorded_policy"] = pol
