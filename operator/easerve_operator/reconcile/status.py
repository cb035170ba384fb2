"""Status from observations: a pure function, so every condition rule is unit-tested without a cluster.

Condition semantics (documented in docs/api.md and relied on by the Argo CD health check):

======================  ==========  ==============================================================
situation               phase       conditions (True ones)
======================  ==========  ==============================================================
spec breaks a rule      Failed      Degraded=InvalidSpec, Stalled=InvalidSpec
a child was refused     Degraded    Degraded=ApplyFailed, Stalled=ApplyFailed
pods unschedulable      Degraded    Degraded=InsufficientCapacity, Stalled=InsufficientCapacity,
                                    Progressing/Reconciling=PodsNotReady
rolling out / starting  Progressing Progressing=PodsNotReady, Reconciling=PodsNotReady
everything ready        Ready       Ready=AllStagesReady
======================  ==========  ==============================================================

``lastTransitionTime`` only moves when a condition's status flips, as Kubernetes conventions ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.api.status import Phase, Reason

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Reconciling", "Stalled")


@dataclass(frozen=True)
class StageObservation:
    """What the operator sees of one stage's Deployment."""

    desired: int
    ready: int = 0
    updated: int = 0
    total: int = 0  # pods of any template, old ones included
    rolled_out: bool = False  # the Deployment controller has observed our latest template

    @classmethod
    def from_deployment(cls, body: dict[str, Any] | None, desired: int) -> StageObservation:
        if body is None:
            return cls(desired=desired)
        status = body.get("status") or {}
        gen = (body.get("metadata") or {}).get("generation")
        return cls(
            desired=desired,
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            total=int(status.get("replicas") or 0),
            rolled_out=gen is not None and status.get("observedGeneration") == gen,
        )

    @property
    def complete(self) -> bool:
        if self.desired == 0:
            return self.total == 0 and (self.rolled_out or self.updated == 0)
        return (
            self.rolled_out
            and self.updated == self.desired
            and self.ready >= self.desired
            and self.total == self.desired
        )


def _cond(ctype: str, true: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    c: dict[str, Any] = {"type": ctype, "status": "True" if true else "False", "reason": str(reason)}
    if message:
        c["message"] = message
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def _stamp(new: list[dict[str, Any]], old: list[dict[str, Any]] | None, now: str) -> list[dict[str, Any]]:
    prev = {c.get("type"): c for c in old or []}
    for c in new:
        p = prev.get(c["type"])
        c["lastTransitionTime"] = (
            p.get("lastTransitionTime", now) if p and p.get("status") == c["status"] else now
        )
    return new


def effective(spec: EPDDeploymentSpec) -> dict[str, Any]:
    return {
        "allocation": spec.allocation.wire(),
        "allocationLabel": spec.allocation.label(),
        "batchBound": spec.encode.batch_bound,
        "offloadRatio": spec.offload.ratio,
        "source": "spec",
    }


def compute_status(
    *,
    generation: int | None,
    spec: EPDDeploymentSpec | None,
    errors: list[str],
    stages: dict[str, StageObservation],
    unschedulable: list[str] | None = None,
    apply_error: str | None = None,
    previous_conditions: list[dict[str, Any]] | None = None,
    now: str,
) -> dict[str, Any]:
    """The full ``status`` (minus kopf's own bookkeeping) for one EPDDeployment."""
    g = generation
    unschedulable = unschedulable or []
    out: dict[str, Any] = {"observedGeneration": g}
    if errors or spec is None:
        msg = "; ".join(errors) or "spec is invalid"
        conds = [
            _cond("Ready", False, Reason.INVALID_SPEC, msg, g),
            _cond("Progressing", False, Reason.INVALID_SPEC, "nothing is created until the spec is fixed", g),
            _cond("Degraded", True, Reason.INVALID_SPEC, msg, g),
            _cond("Reconciling", False, Reason.INVALID_SPEC, "", g),
            _cond("Stalled", True, Reason.INVALID_SPEC, msg, g),
        ]
        out.update(phase=Phase.FAILED.value, conditions=_stamp(conds, previous_conditions, now))
        return out

    obs = stages  # one entry per rendered Deployment (encode/prefill/decode, or omni)
    out["stages"] = {s: {"desired": o.desired, "ready": min(o.ready, o.desired)} for s, o in obs.items()}
    out["readySummary"] = ",".join(f"{v['ready']}/{v['desired']}" for v in out["stages"].values())
    out["effective"] = effective(spec)
    all_ready = all(o.complete for o in obs.values())
    waiting = ", ".join(
        f"{s} {min(o.ready, o.desired)}/{o.desired} ready" + ("" if o.rolled_out else " (rolling out)")
        for s, o in obs.items()
        if not o.complete
    )
    if apply_error:
        conds = [
            _cond("Ready", False, Reason.APPLY_FAILED, apply_error, g),
            _cond("Progressing", False, Reason.APPLY_FAILED, apply_error, g),
            _cond("Degraded", True, Reason.APPLY_FAILED, apply_error, g),
            _cond("Reconciling", False, Reason.APPLY_FAILED, "", g),
            _cond("Stalled", True, Reason.APPLY_FAILED, apply_error, g),
        ]
        phase = Phase.DEGRADED
    elif unschedulable:
        msg = f"{len(unschedulable)} pod(s) cannot be scheduled: {unschedulable[0]}"
        conds = [
            _cond("Ready", False, Reason.INSUFFICIENT_CAPACITY, msg, g),
            _cond("Progressing", True, Reason.PODS_NOT_READY, waiting or msg, g),
            _cond("Degraded", True, Reason.INSUFFICIENT_CAPACITY, msg, g),
            _cond("Reconciling", True, Reason.PODS_NOT_READY, waiting or msg, g),
            _cond("Stalled", True, Reason.INSUFFICIENT_CAPACITY, msg, g),
        ]
        phase = Phase.DEGRADED
    elif not all_ready:
        conds = [
            _cond("Ready", False, Reason.PODS_NOT_READY, waiting, g),
            _cond("Progressing", True, Reason.PODS_NOT_READY, waiting, g),
            _cond("Degraded", False, Reason.AS_EXPECTED, "", g),
            _cond("Reconciling", True, Reason.PODS_NOT_READY, waiting, g),
            _cond("Stalled", False, Reason.AS_EXPECTED, "", g),
        ]
        phase = Phase.PROGRESSING
    else:
        msg = f"all stages ready ({out['readySummary']})"
        conds = [
            _cond("Ready", True, Reason.ALL_READY, msg, g),
            _cond("Progressing", False, Reason.AS_EXPECTED, "", g),
            _cond("Degraded", False, Reason.AS_EXPECTED, "", g),
            _cond("Reconciling", False, Reason.AS_EXPECTED, "", g),
            _cond("Stalled", False, Reason.AS_EXPECTED, "", g),
        ]
        phase = Phase.READY
    out.update(phase=phase.value, conditions=_stamp(conds, previous_conditions, now))
    return out


def status_differs(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change anything (so unchanged status is never rewritten)."""
    current = current or {}
    return any(current.get(k) != v for k, v in new.items())
