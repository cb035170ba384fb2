"""An ``OmniEngine`` driven in virtual time: seeded omni workloads, the event loop, solo p95.

The omni twin (``sim.omni``) runs whole workloads through ``simulate``; the live omni server
(``workers.omni``) needs only ``solo_p95``, the SLO base when no measured calibration is given
(each class alone, one request at a time). Both come from here, beside the engine they drive, so
the live server does not import the simulator package.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.api import OmniSpec
from easerve_runtime.omni.engine import Job, OmniEngine
from easerve_runtime.omni.profile import ClassProfile, OmniProfile
from easerve_runtime.omni.systems import make_engine
from easerve_runtime.policies.omni import ClassInfo, PathKind, SLOTable, class_table
from easerve_runtime.workload.arrivals import arrival_times
from easerve_runtime.workload.metrics import percentile


@dataclass(frozen=True, slots=True)
class OmniArrival:
    id: str
    cls: str
    at: float
    prompt_tokens: int
    output_tokens: int
    total_steps: int


def profile_class(profile: OmniProfile, info: ClassInfo) -> ClassProfile:
    """The profile's class for a spec class: by name, else the first with the same output."""
    if info.name in profile.classes:
        return profile.classes[info.name]
    for c in profile.classes.values():
        if c.output == info.output:
            return c
    raise ValueError(
        f"spec.engine.profile: {profile.name} has no class with output {info.output!r} (class {info.name})"
    )


def class_mix(
    profile: OmniProfile, classes: dict[str, ClassInfo], long_path_ratio: float | None
) -> dict[str, float]:
    """Class weights: the profile's mix (by name or output); ``long_path_ratio`` rescales the
    long-path classes to that total share (the short-path ones get the rest)."""
    w = {
        n: profile.mix.get(n, profile.mix.get(profile_class(profile, c).name, 0.0))
        for n, c in classes.items()
    }
    if not any(w.values()):
        w = {n: 1.0 for n in classes}
    if long_path_ratio is not None:
        if not 0.0 <= long_path_ratio <= 1.0:
            raise ValueError(f"long_path_ratio: must be in [0, 1], got {long_path_ratio}")
        longs = [n for n, c in classes.items() if c.path is PathKind.LONG]
        shorts = [n for n in classes if n not in longs]
        lsum = sum(w[n] for n in longs) or float(len(longs))
        ssum = sum(w[n] for n in shorts) or float(len(shorts))
        w = {
            n: (
                long_path_ratio * (w[n] or 1.0) / lsum
                if n in longs
                else (1 - long_path_ratio) * (w[n] or 1.0) / ssum
            )
            for n in classes
        }
    tot = sum(w.values())
    return {n: v / tot for n, v in w.items()}


def make_workload(
    profile: OmniProfile,
    classes: dict[str, ClassInfo],
    rate: float,
    n: int,
    seed: int,
    long_path_ratio: float | None = None,
    only: str | None = None,
) -> list[OmniArrival]:
    rng = random.Random(seed)
    times = arrival_times(rate, n, rng)
    mix = {only: 1.0} if only else class_mix(profile, classes, long_path_ratio)
    names = [k for k, v in mix.items() if v > 0]
    weights = [mix[k] for k in names]
    out: list[OmniArrival] = []
    for i, t in enumerate(times):
        cls = rng.choices(names, weights)[0]
        cp = profile_class(profile, classes[cls])
        out.append(
            OmniArrival(
                id=f"r{i}",
                cls=cls,
                at=t,
                prompt_tokens=cp.prompt_tokens.sample(rng, 16, 16384),
                output_tokens=cp.output_tokens.sample(rng, 1, 8192),
                total_steps=cp.total_steps.sample(rng, cp.first_output_steps, 1 << 16) if cp.long else 0,
            )
        )
    return out


@dataclass
class OmniSimResult:
    system: str
    jobs: list[Job]
    slo: dict[str, float]
    engine: OmniEngine
    makespan: float = 0.0
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        per: dict[str, dict[str, Any]] = {}
        ok_all = 0
        for cls, limit in self.slo.items():
            lat = [j.latency for j in self.jobs if j.req.cls == cls and j.latency is not None]
            ok = sum(1 for x in lat if x <= limit)
            ok_all += ok
            per[cls] = {
                "requests": len(lat),
                "slo_s": limit,
                "attainment": ok / len(lat) if lat else math.nan,
                "p50_s": percentile(lat, 50),
                "p95_s": percentile(lat, 95),
            }
        st = self.engine.stats
        return {
            "system": self.system,
            "requests": len(self.jobs),
            "slo_attainment": ok_all / len(self.jobs) if self.jobs else math.nan,
            "per_class": per,
            "makespan_s": self.makespan,
            "shared_steps": st.shared_steps,
            "mean_hidden_per_step": sum(st.hidden) / len(st.hidden) if st.hidden else 0.0,
            "mean_n": sum(st.n_trace) / len(st.n_trace) if st.n_trace else 0.0,
        }


def simulate(
    profile: OmniProfile, omni: OmniSpec, slo: SLOTable, system: str, workload: Sequence[OmniArrival]
) -> OmniSimResult:
    """Run the workload to completion in virtual time (every request gets its first response)."""
    eng = make_engine(profile, omni, slo, system)
    events: list[tuple[float, int, str, int]] = []
    seq = 0
    for i, a in enumerate(workload):
        events.append((a.at, seq, "arrive", i))
        seq += 1
    heapq.heapify(events)
    now = 0.0
    jobs: list[Job] = []
    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == "arrive":
            a = workload[i]
            jobs.append(eng.submit(a.id, a.cls, a.prompt_tokens, a.output_tokens, a.total_steps, now))
        elif kind == "shared":
            eng.finish_shared(now)
        else:
            eng.finish_down(now)
        d = eng.start_shared(now)
        if d is not None:
            heapq.heappush(events, (now + d, seq, "shared", 0))
            seq += 1
        d = eng.start_down(now)
        if d is not None:
            heapq.heappush(events, (now + d, seq, "down", 0))
            seq += 1
    res = OmniSimResult(system, jobs, slo.as_dict(), eng, makespan=now)
    return res


def solo_p95(profile: OmniProfile, omni: OmniSpec, n: int = 200, seed: int = 1) -> dict[str, float]:
    """Each class alone, one request at a time: its p95 first-response latency (the SLO base)."""
    classes = class_table(omni.classes)
    dummy = SLOTable({c: 1.0 for c in classes}, {})
    out: dict[str, float] = {}
    for cls in classes:
        wl = make_workload(profile, classes, 1e-4, n, seed, only=cls)  # gaps of hours: always alone
        res = simulate(profile, omni, dummy, "vanilla", wl)
        out[cls] = percentile([j.latency for j in res.jobs if j.latency is not None], 95)
    return out


def slo_table(profile: OmniProfile, omni: OmniSpec, seed: int = 1) -> SLOTable:
    return SLOTable.from_spec(omni, solo_p95(profile, omni, seed=seed))
