"""What runs: the spec, with the values HAS tuned filling the fields the spec leaves unset (pure).

The operator never writes ``spec`` (GitOps). So a deployment that wants the tuned configuration
*run*, not only recommended, leaves the searched fields out of its manifest and sets
``spec.tuning.enabled``:

=========================  ======================================================================
searched field             tuned value
=========================  ======================================================================
``allocation``             ``status.tuning.best.specAllocation``
``encode.batchBound``      ``status.tuning.best.batchBound``
``offload.ratio``          ``status.tuning.best.offloadRatio``
``smPartition.mode``       the partition the search's s < 1 trials ran with (``status.tuning.partition``),
                           ``none`` when the tuned s is 1 (no local prefill to share the GPU with)
=========================  ======================================================================

**Explicit values always win**: a field present in the manifest runs as written. "Unset" is read
from the stored object (the CRD carries no defaults, so an omitted field stays omitted and Argo
CD / Flux see no drift). Where the search has no result yet:

* the *first* search of a deployment whose manifest leaves a searched field unset: nothing is
  deployed until it ends (its trials need the GPUs; ``Situation.TUNING``);
* a *new* search (the spec changed): the values tuned before keep running (``previous`` is the
  last ``status.effective``), so re-tuning never takes the service down;
* a failed search, or tuning disabled: the model's defaults run, and say so.

**The autopilot** (``spec.tuning.adapt``, ``reconcile/adapt_loop.py``) then moves the live knobs B and
s with the observed load: ``status.adapt.knobs`` fills ``encode.batchBound`` and ``offload.ratio`` when
the manifest leaves them unset (explicit values are pinned: the autopilot never moves them). Those two
reach running encode workers through the ConfigMap without a restart (``policies.knobs.LIVE_FIELDS``).
With ``allowAllocationChanges`` and ``allocation`` unset in the manifest, ``status.adapt.allocation``
(an allocation the autopilot applied) fills ``allocation`` too, with the s chosen for it and the
partition that s needs (``lay_allocation``); that one changes the pods, so they roll.

``status.effective.sources`` names, per field, where its value came from: ``spec``, ``tuned``,
``adapted`` or ``default``.

WHY the search's *identity* lives here too (``fingerprint``, ``partition``): the daemon that runs
the search and this resolver must agree on which search a result belongs to, and this module is
the pure one (the daemon's module imports kopf).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from easerve_runtime.api import (
    Allocation,
    EPDDeploymentSpec,
    PartitionMode,
    TuningState,
    cross_field_errors,
)
from easerve_runtime.api.status import EffectiveConfig

Source = Literal["spec", "tuned", "adapted", "default"]
SEARCHED: tuple[tuple[str, ...], ...] = (
    ("allocation",),
    ("encode", "batchBound"),
    ("offload", "ratio"),
    ("smPartition", "mode"),
)
"""Wire paths of the fields HAS chooses (``smPartition.mode`` follows the chosen s)."""


# ------------------------------------------------------------------------------------ identity
def fingerprint(spec: EPDDeploymentSpec) -> str:
    """The search's inputs: the spec without the searched dimensions and the SM partition.

    ``smPartition.mode``/``staticEncodeSms`` are left out because adopting a recommendation with
    s = 1 *forces* ``smPartition.mode: none`` (a cross-field rule): a fingerprint with the mode
    restarted the search on adoption. The partition the trials used is ``partition(spec)``."""
    wire = spec.wire()
    wire.pop("allocation", None)
    wire.get("encode", {}).pop("batchBound", None)
    wire.get("offload", {}).pop("ratio", None)
    wire.get("smPartition", {}).pop("mode", None)
    wire.get("smPartition", {}).pop("staticEncodeSms", None)
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def partition(spec: EPDDeploymentSpec) -> str:
    """The partition the search's s < 1 trials run with (``tuning.space.apply_candidate``:
    ``none`` becomes ``dynamic``; ``static`` keeps its encode SMs)."""
    if spec.sm_partition.mode == PartitionMode.STATIC:
        return f"static:{spec.sm_partition.static_encode_sms}"
    return PartitionMode.DYNAMIC.value


def _get(raw: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = raw
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return None
        cur = cur[p]
    return cur


def unset_fields(raw: Mapping[str, Any]) -> list[str]:
    """The searched fields the stored spec leaves out (dotted wire paths)."""
    return [".".join(p) for p in SEARCHED if _get(raw, p) is None]


# ------------------------------------------------------------------------------------ resolve
@dataclass(frozen=True)
class Tuned:
    """The values a finished search chose (or that ran before a new search started)."""

    allocation: Allocation
    batch_bound: int
    offload_ratio: float
    partition: str = PartitionMode.DYNAMIC.value

    def digest(self) -> str:
        d = {"a": self.allocation.wire(), "b": self.batch_bound, "s": self.offload_ratio, "p": self.partition}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Resolved:
    """The spec that runs, where each searched value came from, and whether it waits for a search."""

    spec: EPDDeploymentSpec | None
    sources: dict[str, Source] = field(default_factory=dict)
    waiting: str | None = None
    """Why nothing is deployed yet (the first search runs), else None."""
    errors: list[str] = field(default_factory=list)
    tuned: Tuned | None = None
    adapted: tuple[int, float] | None = None
    """(B, s) the autopilot laid over the unset fields, if any."""
    adapted_allocation: str | None = None
    """The label of the allocation the autopilot applied and laid over, if any."""

    @property
    def key(self) -> str:
        """What distinguishes two resolutions of one generation (the render cache's key)."""
        if self.waiting is not None:
            return "waiting"
        base = self.tuned.digest() if self.tuned is not None else "-"
        if self.adapted is not None:
            base = f"{base}+{self.adapted[0]}/{self.adapted[1]:g}"
        return base if self.adapted_allocation is None else f"{base}@{self.adapted_allocation}"

    def effective(self) -> EffectiveConfig | None:
        if self.spec is None or self.waiting is not None:
            return None
        s = self.spec
        return EffectiveConfig(
            allocation=s.allocation,
            allocation_label=s.allocation.label(),
            batch_bound=s.encode.batch_bound,
            offload_ratio=s.offload.ratio,
            source="tuning" if "tuned" in self.sources.values() else "spec",
            sources=dict(self.sources),
            sm_partition=str(s.sm_partition.mode),
        )


def tuned_from_status(tuning: Mapping[str, Any] | None, fp: str) -> Tuned | None:
    """The result of the finished search of fingerprint ``fp`` in ``status.tuning``, if any."""
    if not tuning or tuning.get("state") != TuningState.SUCCEEDED or tuning.get("fingerprint") != fp:
        return None
    best = tuning.get("best") or {}
    if not best.get("specAllocation"):
        return None
    return Tuned(
        allocation=Allocation.model_validate(best["specAllocation"]),
        batch_bound=int(best["batchBound"]),
        offload_ratio=float(best["offloadRatio"]),
        partition=str(tuning.get("partition") or PartitionMode.DYNAMIC.value),
    )


def tuned_from_effective(effective: Mapping[str, Any] | None) -> Tuned | None:
    """What ran last with tuned values (``status.effective``), to keep running during a new search."""
    if not effective or "tuned" not in (effective.get("sources") or {}).values():
        return None
    try:
        alloc = Allocation.model_validate(effective["allocation"])
        mode = str(effective.get("smPartition") or PartitionMode.NONE.value)
        return Tuned(alloc, int(effective["batchBound"]), float(effective["offloadRatio"]),
                     PartitionMode.DYNAMIC.value if mode == PartitionMode.NONE else mode)
    except (KeyError, TypeError, ValueError):
        return None


def _partition_update(spec: EPDDeploymentSpec, s: float, part: str) -> dict[str, Any]:
    if s >= 1.0:
        return {"mode": PartitionMode.NONE.value}
    if part.startswith("static:"):
        return {"mode": PartitionMode.STATIC.value, "static_encode_sms": int(part.split(":", 1)[1])}
    return {"mode": PartitionMode.DYNAMIC.value}


def lay_allocation(
    raw: Mapping[str, Any], spec: EPDDeploymentSpec, allocation: Allocation, s: float
) -> EPDDeploymentSpec | None:
    """``spec`` running ``allocation`` with offload ratio ``s``, or None where the manifest forbids it.

    The autopilot's applied allocation changes (``spec.tuning.adapt.allowAllocationChanges``) go
    through here, both when the autopilot picks a candidate and when the reconciler lays the
    applied one over, so both agree on what may run. Explicit values win: an allocation written in
    the manifest is never replaced, an explicit s must be the one given, an explicit partition mode
    stays (a candidate that then breaks a cross-field rule is refused). An unset mode follows s:
    ``none`` at s = 1 (no local prefill), else the spec's own, ``dynamic`` if that is ``none``."""
    unset = unset_fields(raw)
    if "allocation" not in unset or not spec.tuning.adapt.allow_allocation_changes:
        return None
    upd: dict[str, Any] = {"allocation": allocation}
    if "offload.ratio" in unset:
        upd["offload"] = spec.offload.model_copy(update={"ratio": float(s)})
    elif spec.offload.ratio != s:
        return None
    if "smPartition.mode" in unset:
        if s >= 1.0:
            mode = PartitionMode.NONE.value
        elif spec.sm_partition.mode == PartitionMode.NONE:
            mode = PartitionMode.DYNAMIC.value
        else:
            mode = spec.sm_partition.mode
        upd["sm_partition"] = spec.sm_partition.model_copy(update={"mode": mode})
    out = spec.model_copy(update=upd)
    return None if cross_field_errors(out) else out


def resolve(
    raw: Mapping[str, Any],
    spec: EPDDeploymentSpec,
    tuning: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None = None,
    adapt: Mapping[str, Any] | None = None,
) -> Resolved:
    """``spec`` (parsed from ``raw``) with tuned values on its unset searched fields, then the
    autopilot's live knobs; see the module docstring. ``tuning`` is ``status.tuning``, ``previous``
    the last ``status.effective``, ``adapt`` is ``status.adapt``."""
    r = _resolve_tuned(raw, spec, tuning, previous)
    if r.spec is None or r.waiting is not None or not adapt or not r.spec.tuning.adapt.enabled:
        return r
    knobs = adapt.get("knobs") or {}
    unset = unset_fields(raw)
    upd: dict[str, Any] = {}
    sources = dict(r.sources)
    alloc_label: str | None = None
    base: EPDDeploymentSpec = r.spec
    if adapt.get("allocation") and knobs.get("offloadRatio") is not None:
        try:
            laid = lay_allocation(raw, base, Allocation.model_validate(adapt["allocation"]), float(knobs["offloadRatio"]))
        except ValueError:
            laid = None
        if laid is not None and laid.allocation != base.allocation:
            for f, before, after in (("allocation", base.allocation, laid.allocation),
                                     ("offload.ratio", base.offload.ratio, laid.offload.ratio),
                                     ("smPartition.mode", base.sm_partition.mode, laid.sm_partition.mode)):
                if before != after:
                    sources[f] = "adapted"
            alloc_label = laid.allocation.label()
            base = laid
    before_knobs = dict(sources)
    b = knobs.get("batchBound")
    if "encode.batchBound" in unset and b is not None and int(b) != base.encode.batch_bound:
        upd["encode"] = base.encode.model_copy(update={"batch_bound": int(b)})
        sources["encode.batchBound"] = "adapted"
    s_new = knobs.get("offloadRatio")
    if ("offload.ratio" in unset and s_new is not None and float(s_new) != base.offload.ratio
            and 0.0 < float(s_new) < 1.0 and 0.0 < base.offload.ratio < 1.0):  # within the pod layout
        upd["offload"] = base.offload.model_copy(update={"ratio": float(s_new)})
        sources["offload.ratio"] = "adapted"
    if not upd and alloc_label is None:
        return r
    out = base.model_copy(update=upd)
    if cross_field_errors(out):
        out, sources = base, before_knobs  # an adapted knob that cannot run here is not laid over
    return Resolved(out, sources, tuned=r.tuned, adapted=(out.encode.batch_bound, out.offload.ratio),
                    adapted_allocation=alloc_label)


def _resolve_tuned(
    raw: Mapping[str, Any],
    spec: EPDDeploymentSpec,
    tuning: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None,
) -> Resolved:
    unset = unset_fields(raw)
    spec_src: dict[str, Source] = {".".join(p): "spec" for p in SEARCHED if ".".join(p) not in unset}
    defaults: dict[str, Source] = {**spec_src, **{u: "default" for u in unset}}
    if not spec.tuning.enabled or not unset:
        return Resolved(spec, defaults)
    fp = fingerprint(spec)
    tuned = tuned_from_status(tuning, fp) or tuned_from_effective(previous)
    if tuned is None:
        state = (tuning or {}).get("state")
        if state == TuningState.FAILED and (tuning or {}).get("fingerprint") == fp:
            return Resolved(spec, defaults)  # the search failed: the defaults run (status.tuning says why)
        return Resolved(spec, defaults, waiting=f"HAS chooses {', '.join(unset)}: {_progress(tuning, fp)}")
    upd: dict[str, Any] = {}
    sources = dict(spec_src)
    s = tuned.offload_ratio if "offload.ratio" in unset else spec.offload.ratio
    if "allocation" in unset:
        upd["allocation"], sources["allocation"] = tuned.allocation, "tuned"
    if "encode.batchBound" in unset:
        upd["encode"] = spec.encode.model_copy(update={"batch_bound": tuned.batch_bound})
        sources["encode.batchBound"] = "tuned"
    if "offload.ratio" in unset:
        upd["offload"] = spec.offload.model_copy(update={"ratio": tuned.offload_ratio})
        sources["offload.ratio"] = "tuned"
    if "smPartition.mode" in unset:
        upd["sm_partition"] = spec.sm_partition.model_copy(update=_partition_update(spec, s, tuned.partition))
        sources["smPartition.mode"] = "tuned"
    out = spec.model_copy(update=upd)
    errs = [str(e) for e in cross_field_errors(out)]
    if errs:
        return Resolved(
            None, sources, errors=[f"the tuned values do not fit the explicit ones ({e}): set or unset the fields named"
                                   for e in errs], tuned=tuned,
        )
    return Resolved(out, sources, tuned=tuned)


def _progress(tuning: Mapping[str, Any] | None, fp: str) -> str:
    if not tuning or tuning.get("fingerprint") != fp:
        return "search starting"
    phase = tuning.get("phase") or tuning.get("state") or "Running"
    done, budget = tuning.get("trials"), tuning.get("budget")
    where = tuning.get("trialsOn") or "twin"
    if done is None or budget is None:
        return f"{phase} ({where} trials)"
    return f"{phase}, trial {done}/{budget} ({where} trials)"
