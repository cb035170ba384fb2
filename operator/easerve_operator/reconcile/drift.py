"""Drift detection: does a live object still carry everything we rendered?

The API server adds defaults (``protocol: TCP``, ``imagePullPolicy``...), so live objects are
compared as a *superset* of the rendered one: every field we set must be there with our value;
fields we never set are ignored. Lists must match in length and element-wise, because a list we
render (containers, env, ports) is ours as a whole.
"""

from __future__ import annotations

from typing import Any

# Quantities and ports come back normalised; compare them as strings.
_SCALARS = (str, int, float, bool)


def covers(live: Any, desired: Any) -> bool:
    """True when ``live`` contains ``desired``."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        # the API server drops empty lists and maps, so an empty desired value matches "absent"
        return all(covers(live[k], v) if k in live else v in ([], {}, None) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(covers(a, b) for a, b in zip(live, desired, strict=True))
    if isinstance(desired, _SCALARS) and isinstance(live, _SCALARS):
        return live == desired or str(live) == str(desired)
    return bool(live == desired)


MANAGED_SECTIONS = {"ConfigMap": ("data",), "Deployment": ("spec",), "Service": ("spec",)}


def drifted(live: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether ``live`` must be re-applied: missing, or a field we manage was changed or removed."""
    if live is None:
        return True
    meta_l, meta_d = live.get("metadata") or {}, desired["metadata"]
    if not covers(meta_l.get("labels") or {}, meta_d.get("labels") or {}):
        return True
    if not covers(meta_l.get("annotations") or {}, meta_d.get("annotations") or {}):
        return True
    if not covers(meta_l.get("ownerReferences") or [], meta_d.get("ownerReferences") or []):
        return True
    return any(
        not covers(live.get(sec), desired.get(sec))
        for sec in MANAGED_SECTIONS.get(desired["kind"], ("spec",))
    )
