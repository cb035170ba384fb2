"""Live runtime knobs: which spec changes a RUNNING encode worker may take, and how it takes them.

B and the dispatch parameters (``spec.encode.*``) and the offload ratio s (``spec.offload.ratio``)
are decisions of pure objects (the batcher, the deficit router), so they can change between two
requests without a restart: ``reconfigure_batcher`` keeps every pending item in order and λ̂'s
history, ``DeficitRouter.set_ratio`` carries the deficit over so the split converges to the new s.
Everything else in the spec (allocation, engine, model, partitioning, ...) shapes processes or
pods, so a change of it needs a roll; ``diff_knobs`` names those fields for the log line.

One change of s cannot be applied live even though it is a knob: s < 1 on a worker started with
s = 1 needs a local prefill worker that does not exist (the pod layout has none), and s > 0 on a
worker started with s = 0 needs a remote pool it never connected to. ``apply_knobs`` refuses
those with a reason; the deployment must roll (a layout change). The live encode worker and the
twin both call ``apply_knobs``, so a change behaves the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from easerve_runtime.api import EncodeSpec, EPDDeploymentSpec
from easerve_runtime.policies.batcher import Batcher, reconfigure_batcher
from easerve_runtime.policies.router import DeficitRouter

T = TypeVar("T")

LIVE_FIELDS: dict[str, tuple[str, ...]] = {
    "encode": ("batchBound", "dispatch", "maxAgeMs", "gapQuantile", "rateHalfLifeMs", "timeoutMs"),
    "offload": ("ratio",),
}
"""The spec fields a running encode worker applies without a restart (wire names): what
``reconfigure_batcher`` and ``DeficitRouter.set_ratio`` take. The renderer leaves them out of the
encode pods' config hash, so changing one rewrites the ConfigMap and the pods take it live instead
of rolling (``spec.encode.sendWindow`` is not among them: the send window is sized at start)."""
LIVE_PATHS = tuple(f"spec.{sec}.{f}" for sec, fields in LIVE_FIELDS.items() for f in fields)
"""The same, as wire paths."""


@dataclass(frozen=True)
class KnobChange:
    """The difference between the spec a worker runs and a new one."""

    encode: EncodeSpec | None = None
    """The new ``spec.encode`` when any of its fields changed."""
    ratio: float | None = None
    """The new ``spec.offload.ratio`` when it changed."""
    roll: tuple[str, ...] = ()
    """Wire paths that changed and need a roll (not applied live)."""

    @property
    def live(self) -> bool:
        return self.encode is not None or self.ratio is not None

    @property
    def empty(self) -> bool:
        return not self.live and not self.roll


def _paths(a: Any, b: Any, prefix: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _paths(a.get(k), b.get(k), f"{prefix}.{k}", out)
    elif a != b:
        out.append(prefix)


def diff_knobs(old: EPDDeploymentSpec, new: EPDDeploymentSpec) -> KnobChange:
    """What changed from ``old`` to ``new``, split into live knobs and fields that need a roll."""
    changed: list[str] = []
    _paths(
        old.model_dump(mode="json", by_alias=True),
        new.model_dump(mode="json", by_alias=True),
        "spec",
        changed,
    )
    live = [p for p in changed if p.startswith(LIVE_PATHS)]
    roll = tuple(p for p in changed if p not in live)
    encode = new.encode if any(p.startswith("spec.encode") for p in live) else None
    ratio = float(new.offload.ratio) if "spec.offload.ratio" in live else None
    return KnobChange(encode=encode, ratio=ratio, roll=roll)


@dataclass
class Applied:
    """What ``apply_knobs`` did: the batcher to use from now on, and any refusal."""

    batcher: Any
    applied: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def apply_knobs(
    batcher: Batcher[T],
    router: DeficitRouter | None,
    change: KnobChange,
    *,
    has_local: bool,
    has_remote: bool,
) -> Applied:
    """Apply the live part of ``change`` to one encode worker's batcher and router.

    ``has_local``/``has_remote``: whether this worker has a local prefill worker / a remote pool.
    Returns the batcher to keep (a policy switch builds a new one that adopted the pending items).
    A refused ratio leaves the router as it was; the encode part is applied independently.
    """
    out = Applied(batcher)
    if change.encode is not None:
        out.batcher = reconfigure_batcher(batcher, change.encode)
        out.applied.append(
            f"spec.encode (batchBound={change.encode.batch_bound}, dispatch={change.encode.dispatch})"
        )
    s = change.ratio
    if s is not None:
        if s < 1.0 and not has_local:
            out.refused.append(
                f"spec.offload.ratio={s:g}: this worker has no local prefill worker (started with s = 1); "
                "s < 1 changes the pod layout and needs a roll"
            )
        elif s > 0.0 and not has_remote:
            out.refused.append(
                f"spec.offload.ratio={s:g}: this worker has no remote prefill pool (started with s = 0); needs a roll"
            )
        elif router is None:  # s == 1 everywhere without a local worker: nothing to route
            out.applied.append(f"spec.offload.ratio={s:g}")
        else:
            router.set_ratio(s)
            out.applied.append(f"spec.offload.ratio={s:g}")
    return out
