"""The omni engine core: one shared stage and one downstream stage on one GPU, clock-free.

This is the state machine both drivers share: the discrete-event twin (``easerve_runtime.sim
.omni``, virtual time) and the runtime path (``easerve_runtime.workers.omni``, asyncio sleeps).
A driver calls ``start_shared(now)`` when the shared stage is idle and gets back how long the
step takes, then ``finish_shared(now)`` when that time has passed; same for the downstream.
Step durations come from the omni profile, including the co-running slowdown for the chosen
sharing mode and, under green-context sharing, the SM cap that ``BandwidthThrottle`` picks.

Request life cycle: submitted -> waiting in the shared queue -> prefilled (text: first token;
decode continuation from then on) -> long path: after ``output_tokens`` thinker tokens it hands
off to the downstream -> downstream steps until the first output (TTFO / image) -> done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from easerve_runtime.omni.profile import ClassProfile, OmniProfile, Sharing
from easerve_runtime.policies.omni import ClassInfo, OmniRequest, OmniScheduler, PathKind, SLOTable, StepPlan
from easerve_runtime.policies.partition import BandwidthThrottle
from easerve_runtime.policies.sm_policy import bandwidth_throttle


@dataclass(eq=False)
class Job:
    req: OmniRequest
    prompt_tokens: int
    output_tokens: int
    first_output_steps: int
    total_steps: int
    tokens_done: int = 0
    steps_done: int = 0
    prefilled: bool = False
    first_response: float | None = None
    done: float | None = None
    base_remaining: float = 0.0

    @property
    def latency(self) -> float | None:
        return None if self.first_response is None else self.first_response - self.req.arrival


@dataclass
class EngineStats:
    shared_steps: int = 0
    down_steps: int = 0
    hidden: list[int] = field(default_factory=list)
    n_trace: list[int] = field(default_factory=list)
    cap_trace: list[tuple[float, int]] = field(default_factory=list)
    bw_ewma: float = 0.0
    decode_gaps: list[float] = field(default_factory=list)


def make_throttle(profile: OmniProfile) -> BandwidthThrottle:
    """The omni GPU's bandwidth throttle, built by the one spec -> partition policy home
    (``policies.sm_policy.bandwidth_throttle``, which the pod's partition controller uses too)."""
    return bandwidth_throttle(profile.throttle, profile.total_sms)


class OmniEngine:
    def __init__(
        self,
        profile: OmniProfile,
        scheduler: OmniScheduler,
        slo: SLOTable,
        classes: Mapping[str, ClassInfo],
        sharing: Sharing,
        throttle: BandwidthThrottle | None = None,
        on_first_response: Callable[[Job, float], None] | None = None,
    ) -> None:
        if sharing is Sharing.GREEN and throttle is None:
            raise ValueError("throttle: green-context sharing needs a BandwidthThrottle")
        self.profile = profile
        self.scheduler = scheduler
        self.slo = slo
        self.classes = classes
        self.sharing = sharing
        self.throttle = throttle
        self.on_first_response = on_first_response
        self.queue: list[OmniRequest] = []  # shared stage: waiting prefills + decode continuations
        self.down: list[Job] = []  # downstream: long-path requests handed off
        self.jobs: dict[str, Job] = {}
        self.shared_batch: list[Job] | None = None
        self.down_batch: list[Job] | None = None
        self.shared_sms = profile.total_sms
        self.last_plan: StepPlan | None = None
        self.step_ewma = 0.0
        self.stats = EngineStats()

    # -- admission ------------------------------------------------------------------------

    def submit(
        self, rid: str, cls: str, prompt_tokens: int, output_tokens: int, total_steps: int, now: float
    ) -> Job:
        if cls not in self.classes:
            raise ValueError(f"class: {cls!r} is not in spec.omni.classes {sorted(self.classes)}")
        if rid in self.jobs:
            raise ValueError(f"id: duplicate request id {rid!r}")
        info = self.classes[cls]
        cp = self.profile.classes.get(cls) or self._class_by_output(info.output)
        first_steps = cp.first_output_steps if info.path is PathKind.LONG else 0
        total = max(total_steps, first_steps)
        req = OmniRequest(
            id=rid,
            cls=cls,
            path=info.path,
            arrival=now,
            deadline=now + self.slo.seconds(cls),
            remaining_s=0.0,
            prefill_tokens=max(1, prompt_tokens),
        )
        job = Job(req, max(1, prompt_tokens), max(1, output_tokens), first_steps, total)
        job.base_remaining = req.remaining_s = self._remaining(job)
        self.jobs[rid] = job
        self.queue.append(req)
        return job

    def _class_by_output(self, output: str) -> ClassProfile:
        for c in self.profile.classes.values():
            if c.output == output:
                return c
        raise ValueError(f"spec.engine.profile: {self.profile.name} has no class with output {output!r}")

    def _remaining(self, job: Job) -> float:
        cls = job.req.cls
        if cls not in self.profile.classes:
            cls = self._class_by_output(self.classes[cls].output).name
        return self.profile.remaining_s(
            cls,
            job.prompt_tokens,
            job.prefilled,
            max(0, job.output_tokens - job.tokens_done),
            max(0, job.first_output_steps - job.steps_done),
        )

    # -- shared stage -----------------------------------------------------------------------

    @property
    def down_active(self) -> bool:
        return bool(self.down)

    def start_shared(self, now: float) -> float | None:
        """Plan and start one shared-stage step; returns its duration, or None if idle."""
        if self.shared_batch is not None or not self.queue:
            return None
        # r_hat = profile estimate minus progress, plus one shared step of granularity: a waiting
        # request cannot finish before the step it joins does (EWMA of recent step durations).
        g = self.step_ewma
        for r in self.queue:
            r.remaining_s = self.jobs[r.id].base_remaining + g
        plan = self.scheduler.schedule(self.queue, now)
        self.last_plan = plan
        if not plan.batch:
            return None
        self.stats.hidden.append(plan.hidden)
        self.stats.n_trace.append(plan.n)
        batch = [self.jobs[r.id] for r in plan.batch]
        prefill_tokens = sum(j.prompt_tokens for j in batch if not j.prefilled)
        decodes = [j for j in batch if j.prefilled]
        ctx = sum(j.prompt_tokens + j.tokens_done for j in decodes)
        base = self.profile.shared_step_s(prefill_tokens, len(decodes), ctx)
        if self.sharing is Sharing.GREEN:
            assert self.throttle is not None
            split = self.throttle.decide(self.down_active, now)
            if split.primary_sms != self.shared_sms or not self.stats.cap_trace:
                self.stats.cap_trace.append((now, split.primary_sms))
            self.shared_sms = split.primary_sms
        f_sh, _, mem = self.profile.slowdown(self.sharing, self.shared_sms, True, self.down_active)
        if self.throttle is not None:
            self.stats.bw_ewma = self.throttle.observe(mem)
        self.shared_batch = batch
        self.stats.shared_steps += 1
        dur = base * f_sh
        self.step_ewma = dur if self.stats.shared_steps == 1 else 0.2 * dur + 0.8 * self.step_ewma
        return dur

    def finish_shared(self, now: float) -> list[Job]:
        """Complete the running shared step; returns jobs whose first response happened now."""
        batch, self.shared_batch = self.shared_batch or [], None
        firsts: list[Job] = []
        leaving: set[int] = set()
        for j in batch:
            if not j.prefilled:
                j.prefilled = True
                j.req.in_decode = True
            j.tokens_done += 1
            if j.req.path is PathKind.SHORT:
                if j.first_response is None:
                    j.first_response = now
                    firsts.append(j)
                if j.tokens_done >= j.output_tokens:
                    j.done = now
                    leaving.add(id(j.req))
            elif j.tokens_done >= j.output_tokens:  # hand off to the downstream stage
                leaving.add(id(j.req))
                self.down.append(j)
            j.base_remaining = j.req.remaining_s = self._remaining(j)
        if leaving:
            self.queue[:] = [r for r in self.queue if id(r) not in leaving]
        for j in firsts:
            self._first(j, now)
        return firsts

    # -- downstream stage -----------------------------------------------------------------

    def start_down(self, now: float) -> float | None:
        if self.down_batch is not None or not self.down:
            return None
        batch = self.down[: self.profile.down_max_batch]
        shared_active = self.shared_batch is not None or bool(self.queue)
        _, f_dn, _ = self.profile.slowdown(self.sharing, self.shared_sms, shared_active, True)
        self.down_batch = batch
        self.stats.down_steps += 1
        return self.profile.down_step_s(len(batch)) * f_dn

    def finish_down(self, now: float) -> list[Job]:
        batch, self.down_batch = self.down_batch or [], None
        firsts: list[Job] = []
        for j in batch:
            j.steps_done += 1
            if j.first_response is None and j.steps_done >= j.first_output_steps:
                j.first_response = now
                firsts.append(j)
            if j.steps_done >= j.total_steps:
                j.done = now
        if any(j.done is not None for j in batch):
            self.down = [j for j in self.down if j.done is None]
        for j in firsts:
            self._first(j, now)
        return firsts

    def _first(self, job: Job, now: float) -> None:
        if self.on_first_response is not None:
            self.on_first_response(job, now)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.down and self.shared_batch is None and self.down_batch is None
