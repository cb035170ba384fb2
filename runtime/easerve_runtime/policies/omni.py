"""HorizonServe's temporal scheduler for one omni model on one GPU (§4.2–§4.3), as a pure wrapper.

An omni model has a *shared stage* (the thinker: prefill + decode) that every request passes
through, and *downstream stages* (talker/codec, waveform decoder, diffusion) that only long-path
requests (audio, image output) continue into. Short-path (text) requests have SLOs one to two
orders of magnitude tighter than long-path ones, so letting long-path prefills take shared-stage
slots first-come-first-served wrecks the short path. This module decides, at every shared-stage
step, which requests the base scheduler may *see*:

1. every request carries a class (from its output modality / API priority), a deadline
   ``d = arrival + Delta_class`` and a slack ratio ``u = (d - t) / r_hat``; it is *protected*
   when ``u < u_guard``;
2. step ``k`` is a short-path phase when ``k mod (N + M) < N``, a long-path phase otherwise;
   ordinary (unprotected) prefills of the other path are hidden for that step;
3. protected requests and decode continuations always stay visible;
4. at most ``long_path_cap`` ordinary long-path prefills stay visible, earliest deadlines first;
5. the base scheduler (FCFS or EDF) picks the batch from that view; the queue itself is never
   reordered, so "restoring" the hidden requests is free (the view is a separate list);
6. ``M`` is fixed (2) and ``N`` maps linearly from the protected fraction of waiting short-path
   requests onto ``[n_min, n_max]``.

Nothing here reads a clock or does I/O: ``now`` is passed in, and the twin (``easerve_runtime.sim
.omni``) and the runtime path (``easerve_runtime.workers.omni``) drive the same objects.

One deliberate addition to the paper: the rotation is *work-conserving*. If the current phase's
path has no visible prefill at all, nothing is hidden for that step (hiding would leave shared-
stage slots idle while work waits, which only adds delay). The paper's wording ("ordinary
short-path prefill requests *can* be hidden") leaves room for this; docs/omni.md explains it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from easerve_runtime.api import OmniClass, OmniSpec, OutputModality

DEFAULT_PRIORITY: dict[str, int] = {"text": 0, "audio": 10, "image": 20}
"""API priority -> output modality (HorizonServe §5): 0 text, 10 audio, 20 image."""

DEFAULT_U_GUARD = 1.5
"""Slack ratio under which a request is protected. ``u = 1`` means the remaining-time estimate
exactly fills the time left; the 0.5 guard band absorbs estimator error (r_hat is a coarse
profile-based estimate), the granularity of one shared-stage step and runtime variation. It
matches ``OmniSpec.u_guard``'s default."""

SHORT_OUTPUTS = frozenset({"text"})
"""Outputs whose first response comes straight from the shared stage (short path)."""


class PathKind(StrEnum):
    SHORT = "short"
    LONG = "long"


def path_for_output(output: str) -> PathKind:
    return PathKind.SHORT if output in SHORT_OUTPUTS else PathKind.LONG


@dataclass(slots=True, eq=False)
class OmniRequest:
    """One request as the shared-stage scheduler sees it.

    ``remaining_s`` is ``r_hat``: the engine sets it from the stage profiles at admission and
    lowers it as the request makes progress (prefill done, decode tokens, downstream steps).
    ``in_decode`` marks a decode continuation (prefill done, thinker still generating).
    Identity equality (``eq=False``) keeps membership tests O(1)-cheap and unambiguous.
    """

    id: str
    cls: str
    path: PathKind
    arrival: float
    deadline: float
    remaining_s: float
    prefill_tokens: int = 1
    in_decode: bool = False
    protected: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def slack(self, now: float) -> float:
        """``u = (d - t) / r_hat`` (``r_hat`` floored at 1 µs so a finished estimate stays finite)."""
        return (self.deadline - now) / max(self.remaining_s, 1e-6)


# --------------------------------------------------------------------------- classes and SLOs


@dataclass(frozen=True, slots=True)
class ClassInfo:
    name: str
    output: str
    priority: int
    path: PathKind


def class_table(classes: Iterable[OmniClass]) -> dict[str, ClassInfo]:
    """Name -> class info, with API priorities defaulted from the output (0/10/20)."""
    out: dict[str, ClassInfo] = {}
    for c in classes:
        output = str(c.output)
        prio = c.priority if c.priority is not None else DEFAULT_PRIORITY[output]
        out[c.name] = ClassInfo(c.name, output, prio, path_for_output(output))
    return out


def class_for_priority(classes: Mapping[str, ClassInfo], priority: int) -> ClassInfo:
    """The class an API request with ``priority`` belongs to (HorizonServe §5).

    Raises ``ValueError`` naming the field when no configured class has that priority, so an
    unknown priority is rejected instead of silently served as text.
    """
    for c in classes.values():
        if c.priority == priority:
            return c
    known = sorted({c.priority for c in classes.values()})
    raise ValueError(f"priority: {priority} matches no class in spec.omni.classes (known priorities {known})")


@dataclass
class SLOTable:
    """Per-class first-response SLO ``Delta_c = solo_p95(c) * m_c`` (or an absolute override).

    It round-trips through JSON (``to_json``/``from_json``) so that ``easerve calibrate-slo`` can
    write it and the workers can load it from a ConfigMap or file: recalibrating needs no rebuild.
    """

    solo_p95_s: dict[str, float]
    multiplier: dict[str, float]
    override_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, v in {**self.solo_p95_s, **self.override_s}.items():
            if not v > 0:
                raise ValueError(f"slo table: class {name!r} has non-positive latency {v}")
        for name in self.multiplier:
            if name not in self.solo_p95_s and name not in self.override_s:
                raise ValueError(f"slo table: class {name!r} has a multiplier but no solo p95 or override")

    def seconds(self, cls: str) -> float:
        if cls in self.override_s:
            return self.override_s[cls]
        try:
            return self.solo_p95_s[cls] * self.multiplier.get(cls, 5.0)
        except KeyError:
            raise KeyError(f"slo table: no entry for class {cls!r}") from None

    def as_dict(self) -> dict[str, float]:
        names = sorted(set(self.solo_p95_s) | set(self.override_s))
        return {n: self.seconds(n) for n in names}

    @classmethod
    def from_spec(cls, spec: OmniSpec, solo_p95_s: Mapping[str, float]) -> SLOTable:
        """Build from ``spec.omni.classes``: ``sloSeconds`` wins, else ``solo_p95 * sloMultiplier``."""
        solo: dict[str, float] = {}
        mult: dict[str, float] = {}
        over: dict[str, float] = {}
        for c in spec.classes:
            if c.slo_seconds is not None:
                over[c.name] = c.slo_seconds
            elif c.name not in solo_p95_s:
                raise ValueError(
                    f"spec.omni.classes[{c.name}]: no sloSeconds and no solo p95 to multiply "
                    f"(run `easerve calibrate-slo` or set sloSeconds)"
                )
            if c.name in solo_p95_s:
                solo[c.name] = float(solo_p95_s[c.name])
                mult[c.name] = c.slo_multiplier
        return cls(solo, mult, over)

    def to_json(self) -> str:
        return json.dumps(
            {
                "soloP95Seconds": self.solo_p95_s,
                "multiplier": self.multiplier,
                "overrideSeconds": self.override_s,
                "sloSeconds": self.as_dict(),
            },
            sort_keys=True,
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> SLOTable:
        d = json.loads(text)
        try:
            return cls(
                {k: float(v) for k, v in d["soloP95Seconds"].items()},
                {k: float(v) for k, v in d.get("multiplier", {}).items()},
                {k: float(v) for k, v in d.get("overrideSeconds", {}).items()},
            )
        except KeyError as exc:
            raise ValueError(f"slo table: missing field {exc.args[0]!r}") from None


# --------------------------------------------------------------------------- base schedulers


class BaseScheduler(Protocol):
    """Picks one shared-stage batch from a (possibly filtered) queue view."""

    def pick(self, view: Sequence[OmniRequest], now: float) -> list[OmniRequest]: ...


@dataclass
class FCFSScheduler:
    """vLLM-style: decode continuations first (up to ``max_seqs``), then prefills in queue order
    while the prefill token budget lasts (the first prefill is always admitted, so a prompt
    larger than the budget cannot starve)."""

    max_seqs: int = 64
    max_prefill_tokens: int = 4096
    max_prefills: int = 16

    def pick(self, view: Sequence[OmniRequest], now: float) -> list[OmniRequest]:
        decodes = [r for r in view if r.in_decode][: self.max_seqs]
        return decodes + self._prefills((r for r in view if not r.in_decode), len(decodes))

    def _prefills(self, cands: Iterable[OmniRequest], n_seqs: int) -> list[OmniRequest]:
        out: list[OmniRequest] = []
        tokens = 0
        for r in cands:
            if n_seqs + len(out) >= self.max_seqs or len(out) >= self.max_prefills:
                break
            if out and tokens + r.prefill_tokens > self.max_prefill_tokens:
                break
            out.append(r)
            tokens += r.prefill_tokens
        return out


@dataclass
class EDFScheduler(FCFSScheduler):
    """Like FCFS, but waiting prefills are taken in first-response-deadline order."""

    def pick(self, view: Sequence[OmniRequest], now: float) -> list[OmniRequest]:
        decodes = [r for r in view if r.in_decode][: self.max_seqs]
        waiting = sorted((r for r in view if not r.in_decode), key=lambda r: r.deadline)
        return decodes + self._prefills(waiting, len(decodes))


# --------------------------------------------------------------------------- the wrapper


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one shared-stage step decided (for the engine and for metrics)."""

    batch: list[OmniRequest]
    phase: PathKind
    n: int
    hidden: int
    step: int


class OmniScheduler:
    """HorizonServe's queue-view wrapper over a base scheduler.

    ``rotation=False`` turns the wrapper into a pass-through that still annotates (the
    no-rotation ablation and the plain FCFS/EDF baselines use the same object, so the overhead
    comparison is fair).
    """

    def __init__(
        self,
        base: BaseScheduler,
        *,
        rotation_m: int = 2,
        n_min: int = 2,
        n_max: int = 8,
        long_path_cap: int = 4,
        u_guard: float = DEFAULT_U_GUARD,
        rotation: bool = True,
    ) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"n_min/n_max: need 1 <= n_min <= n_max, got {n_min}/{n_max}")
        if rotation_m < 1:
            raise ValueError(f"rotation_m: must be >= 1, got {rotation_m}")
        if long_path_cap < 1:
            raise ValueError(f"long_path_cap: must be >= 1, got {long_path_cap}")
        if not u_guard > 0:
            raise ValueError(f"u_guard: must be > 0, got {u_guard}")
        self.base = base
        self.m = rotation_m
        self.n_min = n_min
        self.n_max = n_max
        self.n = n_min
        self.long_path_cap = long_path_cap
        self.u_guard = u_guard
        self.rotation = rotation
        self.k = 0

    @classmethod
    def from_spec(cls, spec: OmniSpec, base: BaseScheduler, *, rotation: bool = True) -> OmniScheduler:
        return cls(
            base,
            rotation_m=spec.rotation_m,
            n_min=spec.n_min,
            n_max=spec.n_max,
            long_path_cap=spec.long_path_cap,
            u_guard=spec.u_guard,
            rotation=rotation,
        )

    # -- signals --------------------------------------------------------------------------

    def annotate(self, queue: Sequence[OmniRequest], now: float) -> None:
        """Refresh every request's protected bit: ``(d - t) / r_hat < u_guard``."""
        g = self.u_guard
        for r in queue:
            rem = r.remaining_s if r.remaining_s > 1e-6 else 1e-6
            r.protected = (r.deadline - now) < g * rem

    def adapt_n(self, queue: Sequence[OmniRequest]) -> int:
        """``N`` from the protected fraction of waiting short-path prefills, linear on [n_min, n_max]."""
        waiting = protected = 0
        for r in queue:
            if r.path is PathKind.SHORT and not r.in_decode:
                waiting += 1
                protected += r.protected
        frac = protected / waiting if waiting else 0.0
        self.n = int(round(self.n_min + frac * (self.n_max - self.n_min)))
        return self.n

    def phase(self, k: int | None = None) -> PathKind:
        k = self.k if k is None else k
        return PathKind.SHORT if k % (self.n + self.m) < self.n else PathKind.LONG

    # -- the view -------------------------------------------------------------------------

    def view(self, queue: Sequence[OmniRequest], phase: PathKind) -> tuple[list[OmniRequest], int]:
        """The filtered queue (original order) and how many requests it hides."""
        if not self.rotation:
            return list(queue), 0
        long_, short = PathKind.LONG, PathKind.SHORT
        other = long_ if phase is short else short
        phase_has_work = False
        long_ordinary: list[OmniRequest] = []
        for r in queue:
            if r.in_decode:
                continue
            if r.path is phase:
                phase_has_work = True
            if r.path is long_ and not r.protected:
                long_ordinary.append(r)
        # Work conservation: if the phase's path has no prefill waiting, hide nothing by phase.
        hide_path = other if phase_has_work else None
        capped: set[int] = set()
        if len(long_ordinary) > self.long_path_cap:
            long_ordinary.sort(key=_deadline)  # stable: ties keep queue order
            capped = {id(r) for r in long_ordinary[self.long_path_cap :]}
        out: list[OmniRequest] = []
        for r in queue:
            if (
                r.in_decode
                or r.protected
                or (r.path is not hide_path and (not capped or id(r) not in capped))
            ):
                out.append(r)
        return out, len(queue) - len(out)

    def schedule(self, queue: Sequence[OmniRequest], now: float) -> StepPlan:
        """One shared-stage step: annotate, adapt N, pick the phase, filter, let the base pick.

        ``queue`` is not modified (the hidden requests are "restored" by construction); the
        caller removes the picked prefills from its waiting list.
        """
        self.annotate(queue, now)
        if self.rotation:
            self.adapt_n(queue)
        ph = self.phase()
        visible, hidden = self.view(queue, ph)
        batch = self.base.pick(visible, now)
        plan = StepPlan(batch=batch, phase=ph, n=self.n, hidden=hidden, step=self.k)
        self.k += 1
        return plan


def _deadline(r: OmniRequest) -> float:
    return r.deadline


def remove_picked(queue: list[OmniRequest], batch: Sequence[OmniRequest]) -> None:
    """Drop the batch's members from ``queue`` in place, keeping everyone else's order."""
    picked = {id(r) for r in batch}
    queue[:] = [r for r in queue if id(r) not in picked]


def output_of(classes: Mapping[str, ClassInfo], cls: str) -> OutputModality:
    return OutputModality(classes[cls].output)
