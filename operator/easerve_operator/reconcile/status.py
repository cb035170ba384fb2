"""Status from observations: a pure function, so every condition rule is unit-tested without a cluster.

The condition semantics are the one table ``easerve_runtime.api.status.CONDITIONS`` (situation ->
phase -> conditions, printed in docs/api.md and relied on by the Argo CD health check); this
module only decides *which* situation applies and fills in the messages. The result is the typed
``EPDDeploymentStatus``; ``.wire()`` is the patch body.

``lastTransitionTime`` only moves when a condition's status flips, as Kubernetes conventions ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.api.status import (
    CONDITIONS,
    Condition,
    EffectiveConfig,
    EPDDeploymentStatus,
    Message,
    Situation,
    StagesStatus,
    StageStatus,
)


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


def _stamp(new: list[Condition], old: list[dict[str, Any]] | None, now: str) -> list[Condition]:
    prev = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        p = prev.get(c.type)
        since = p.get("lastTransitionTime", now) if p and p.get("status") == c.status else now
        out.append(c.model_copy(update={"last_transition_time": since}))
    return out


def effective(spec: EPDDeploymentSpec) -> EffectiveConfig:
    """The spec as written (no tuned values): what runs when ``reconcile.effective`` changes nothing."""
    return EffectiveConfig(
        allocation=spec.allocation,
        allocation_label=spec.allocation.label(),
        batch_bound=spec.encode.batch_bound,
        offload_ratio=spec.offload.ratio,
        sm_partition=str(spec.sm_partition.mode),
        source="spec",
    )


def conditions_for(
    situation: Situation, generation: int | None, texts: dict[Message, str]
) -> tuple[str, list[Condition]]:
    """The phase and conditions of ``situation``, straight from the table."""
    row = CONDITIONS[situation]
    conds = []
    for rule in row.conditions:
        text = texts.get(rule.message, rule.message.value) if rule.message != Message.NONE else ""
        conds.append(
            Condition(
                type=rule.type,
                status="True" if rule.true else "False",
                reason=rule.reason.value,
                message=text or None,
                observed_generation=generation,
            )
        )
    return row.phase.value, conds


def compute_status(
    *,
    generation: int | None,
    spec: EPDDeploymentSpec | None,
    errors: list[str],
    stages: dict[str, StageObservation],
    unschedulable: list[str] | None = None,
    apply_error: str | None = None,
    previous_conditions: list[dict[str, Any]] | None = None,
    config_hash: str | None = None,
    now: str,
    effective_config: EffectiveConfig | None = None,
    tuning_wait: str | None = None,
) -> EPDDeploymentStatus:
    """The full ``status`` (minus kopf's own bookkeeping and ``tuning``) for one EPDDeployment.

    ``effective_config``: what runs (``reconcile.effective``; default: the spec as written);
    ``tuning_wait``: why nothing is deployed yet (the first HAS search runs), else None."""
    g = generation
    unschedulable = unschedulable or []
    if errors or spec is None:
        phase, conds = conditions_for(
            Situation.INVALID_SPEC, g, {Message.PROBLEM: "; ".join(errors) or "spec is invalid"}
        )
        return EPDDeploymentStatus(
            observed_generation=g, phase=phase, conditions=_stamp(conds, previous_conditions, now)
        )
    obs = stages  # one entry per rendered Deployment (encode/prefill/decode, or omni)
    per_stage = {s: StageStatus(desired=o.desired, ready=min(o.ready, o.desired)) for s, o in obs.items()}
    summary = ",".join(f"{v.ready}/{v.desired}" for v in per_stage.values())
    waiting = ", ".join(
        f"{s} {min(o.ready, o.desired)}/{o.desired} ready" + ("" if o.rolled_out else " (rolling out)")
        for s, o in obs.items()
        if not o.complete
    )
    texts = {Message.WAITING: waiting, Message.SUMMARY: f"all stages ready ({summary})"}
    if apply_error:
        situation = Situation.APPLY_FAILED
        texts[Message.PROBLEM] = apply_error
    elif tuning_wait is not None:
        situation = Situation.TUNING
        texts[Message.WAITING] = tuning_wait
    elif unschedulable:
        situation = Situation.UNSCHEDULABLE
        texts[Message.PROBLEM] = f"{len(unschedulable)} pod(s) cannot be scheduled: {unschedulable[0]}"
        texts[Message.WAITING] = waiting or texts[Message.PROBLEM]
    elif not all(o.complete for o in obs.values()):
        situation = Situation.PROGRESSING
    else:
        situation = Situation.READY
    phase, conds = conditions_for(situation, g, texts)
    return EPDDeploymentStatus(
        observed_generation=g,
        phase=phase,
        conditions=_stamp(conds, previous_conditions, now),
        stages=StagesStatus(**per_stage),
        ready_summary=summary,
        effective=None if tuning_wait is not None else (effective_config or effective(spec)),
        config_hash=config_hash,
    )


def status_differs(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change anything (so unchanged status is never rewritten)."""
    current = current or {}
    return any(current.get(k) != v for k, v in new.items())
