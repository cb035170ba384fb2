"""The twin's workers in virtual time: encode, local prefill, remote prefill, decode.

Each worker owns a queue and a busy period and charges its latency through the stage model
(``sim/latency.py``, which reads the SAME profile as the runtime's sim engine). Decisions are
never made here: the encode worker asks the real batcher (``policies.batcher``) when to dispatch
and the real SM-split policy (``policies.partition``, via ``sim/shares.py``) how many SMs it
gets; routing uses the real ``DeficitRouter`` and ``LeastOutstanding``. What is modelled here is
only time: who is busy until when.

Modelling choices (documented in docs/twin.md):
- Embedding transfer follows envelope semantics: one transfer per destination per micro-batch,
  costing ``transfer_s(bytes)`` (setup + bytes/bandwidth), serialised on the encode worker's link;
  the local destination shares the GPU and costs nothing.
- Prefill batches whole requests FIFO up to a token budget (at least one request).
- The local prefill worker's speed follows its SM share, which changes whenever its encoder starts
  or finishes a micro-batch: its remaining work is re-timed at every change (progress-based).
- KV handoff costs ``transfer_s(kv_bytes(prompt))`` per request, concurrently.
- Decode is continuous batching: requests join at step boundaries, one token per step, step
  time from batch size and mean context; admission is bounded by KV memory and a sequence cap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from easerve_runtime.policies.knobs import apply_knobs
from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding, Route
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.shares import ShareModel
from easerve_runtime.workload.request import Request, RequestRecord

DEFAULT_PREFILL_TOKEN_BUDGET = 8192
"""Most prompt tokens in one prefill batch (vLLM's default max_num_batched_tokens)."""
DEFAULT_MAX_DECODE_SEQS = 256
"""Most sequences in one decode batch (vLLM's default max_num_seqs)."""


class Job:
    """One request moving through the pipeline, with its record."""

    __slots__ = ("req", "rec", "tokens", "route", "kv_need", "left")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.tokens = req.prompt_tokens + req.media_tokens
        self.kv_need = 0.0  # KV bytes reserved at full length (set by the decode worker)
        self.left = -1  # aggregated baseline: prompt tokens still to prefill (-1: not admitted)
        self.rec = RequestRecord(id=req.id, arrival_s=req.arrival_s, output_tokens=req.output_tokens)
        self.route: str | None = None


class Busy:
    """Accumulates busy seconds for utilisation."""

    __slots__ = ("busy_s",)

    def __init__(self) -> None:
        self.busy_s = 0.0


class DecodeWorker(Busy):
    """Continuous batching: every step emits one token for every running sequence."""

    def __init__(
        self, loop: EventLoop, model: StageModel, tp: int, name: str, max_seqs: int = DEFAULT_MAX_DECODE_SEQS
    ) -> None:
        super().__init__()
        self.loop, self.model, self.tp, self.name = loop, model, tp, name
        self.max_seqs = max_seqs
        self.kv_capacity = model.kv_capacity_bytes(tp)
        self.waiting: deque[Job] = deque()
        self.finishing: list[tuple[int, int, Job]] = []  # (finish step, seq, job)
        self.running = 0
        self.reserved = 0.0  # KV bytes reserved by running sequences at full length
        self.ctx_sum = 0  # current context tokens over running sequences
        self.step = 0
        self.stepping = False
        self.outstanding = 0  # routed here and not finished (includes KV in flight)
        self.on_finish: Callable[[Job], None] | None = None
        self._seq = 0
        self.steps = 0
        self.batch_sum = 0

    def admit(self, job: Job) -> None:
        """KV has arrived: the sequence may join at the next step boundary."""
        self.waiting.append(job)
        if not self.stepping:
            self._start_step()

    def _fits(self, job: Job) -> bool:
        if not job.kv_need:
            job.kv_need = self.model.kv_bytes(job.tokens + job.req.output_tokens)
        need = job.kv_need
        if self.running == 0:
            return True  # a lone sequence always runs (a too-long one would be rejected upstream)
        return self.running < self.max_seqs and self.reserved + need <= self.kv_capacity

    def _start_step(self) -> None:
        w = self.waiting
        while w and self._fits(w[0]):
            job = w.popleft()
            self.running += 1
            self.reserved += job.kv_need
            self.ctx_sum += job.tokens + 1
            self._seq += 1
            heapq.heappush(self.finishing, (self.step + job.req.output_tokens - 1, self._seq, job))
        if self.running == 0:
            self.stepping = False
            return
        self.stepping = True
        n = self.running
        dt = self.model.decode_step_s(n, self.ctx_sum, self.tp)
        self.busy_s += dt
        self.steps += 1
        self.batch_sum += n
        self.loop.at(self.loop.now + dt, self._end_step)

    def _end_step(self) -> None:
        now = self.loop.now
        self.step += 1
        self.ctx_sum += self.running
        f = self.finishing
        while f and f[0][0] <= self.step:
            _, _, job = heapq.heappop(f)
            self.running -= 1
            self.reserved -= job.kv_need
            self.ctx_sum -= job.tokens + job.req.output_tokens
            self.outstanding -= 1
            job.rec.finish_s = now
            if self.on_finish is not None:
                self.on_finish(job)
        self._start_step()


class KVHandoff:
    """After prefill: the first token is out; ship the KV cache to the least-loaded decode worker."""

    def __init__(self, loop: EventLoop, model: StageModel, decoders: list[DecodeWorker]) -> None:
        self.loop, self.model, self.decoders = loop, model, decoders
        self.picker = LeastOutstanding()
        self.outstanding = {d.name: 0 for d in decoders}
        self.by_name = {d.name: d for d in decoders}
        self.on_finish: Callable[[Job], None] | None = None
        for d in decoders:
            d.on_finish = self._finished

    def _finished(self, job: Job) -> None:
        if self.on_finish is not None:
            self.on_finish(job)

    def first_token(self, job: Job) -> None:
        now = self.loop.now
        job.rec.first_token_s = now
        if job.req.output_tokens <= 1:
            job.rec.finish_s = now
            self._finished(job)
            return
        for d in self.decoders:
            self.outstanding[d.name] = d.outstanding
        name = self.picker.pick([d.name for d in self.decoders], self.outstanding)
        dec = self.by_name[name]
        dec.outstanding += 1
        dt = self.model.transfer_s(self.model.kv_bytes(job.tokens))
        self.loop.at(now + dt, dec.admit, job)


class PrefillWorker(Busy):
    """Batched prefill with a token budget. ``share_fn`` gives its SM share (remote: always 1)."""

    def __init__(
        self,
        loop: EventLoop,
        model: StageModel,
        tp: int,
        name: str,
        handoff: KVHandoff,
        local: bool = False,
        token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
    ) -> None:
        super().__init__()
        self.loop, self.model, self.tp, self.name, self.handoff = loop, model, tp, name, handoff
        self.local = local
        self.token_budget = token_budget
        self.queue: deque[Job] = deque()
        self.outstanding = 0
        self.batch: list[Job] = []
        self.tokens = 0
        # progress-based timing (the local worker's speed changes with its SM share)
        self.share = 1.0
        self.dilation = 1.0
        self._frac_left = 0.0
        self._seg_start = 0.0
        self._seg_dur = 0.0
        self._version = 0
        self.batches = 0
        self.tokens_sum = 0
        self.members: dict[int, tuple[float, float]] = {}

    def _duration(self) -> float:
        n = len(self.batch)
        if self.local:
            return self.model.local_prefill_s(self.tokens, self.share, n, self.tp) * self.dilation
        return self.model.prefill_s(self.tokens, self.tp, 1.0, n)

    def enqueue(self, jobs: list[Job]) -> None:
        self.queue.extend(jobs)
        if not self.batch:
            self._start()

    def _start(self) -> None:
        q = self.queue
        if not q:
            return
        batch = [q.popleft()]
        tokens = batch[0].tokens
        while q and tokens + q[0].tokens <= self.token_budget:
            j = q.popleft()
            batch.append(j)
            tokens += j.tokens
        self.batch, self.tokens = batch, tokens
        self.batches += 1
        self.tokens_sum += tokens
        self._frac_left = 1.0
        self._schedule()

    def _schedule(self) -> None:
        """(Re)time the batch in flight from its remaining fraction at the current share."""
        now = self.loop.now
        self._seg_start = now
        self._seg_dur = self._duration()
        self._version += 1
        if self._seg_dur != float("inf"):  # a zero share pauses the batch until the split changes
            self.loop.at(now + self._frac_left * self._seg_dur, self._done, self._version)

    def set_share(self, share: float, dilation: float = 1.0, member: int = 0) -> None:
        """The SM split on GPU ``member`` changed: re-time the remaining work of the batch in flight.

        A local worker of TP k spans k encode GPUs; a TP step runs at the pace of its slowest
        rank, so its share is the smallest of its GPUs' shares (and the largest slowdown).
        """
        self.members[member] = (share, dilation)
        if len(self.members) > 1:
            share = min(v[0] for v in self.members.values())
            dilation = max(v[1] for v in self.members.values())
        if share == self.share and dilation == self.dilation:
            return
        if self.batch:
            now = self.loop.now
            if 0 < self._seg_dur < float("inf"):
                self._frac_left -= (now - self._seg_start) / self._seg_dur
                self._frac_left = max(self._frac_left, 0.0)
            self.busy_s += now - self._seg_start
            self.share, self.dilation = share, dilation
            self._schedule()
        else:
            self.share, self.dilation = share, dilation

    def _done(self, version: int) -> None:
        if version != self._version:
            return  # re-timed after an SM split change
        self.busy_s += self.loop.now - self._seg_start
        batch = self.batch
        self.batch = []
        for job in batch:
            self.outstanding -= 1
            self.handoff.first_token(job)
        self._start()


class EncodeWorker(Busy):
    """One encode GPU: the real batcher decides dispatch, the real split policy the SM share."""

    def __init__(
        self,
        loop: EventLoop,
        model: StageModel,
        shares: ShareModel,
        batcher: Any,
        name: str,
        router: DeficitRouter | None,
        remote: list[PrefillWorker],
        local: PrefillWorker | None,
        reasons: dict[str, int],
        member: int = 0,
    ) -> None:
        super().__init__()
        self.loop, self.model, self.shares, self.batcher, self.name = loop, model, shares, batcher, name
        self.router, self.remote, self.local, self.reasons = router, remote, local, reasons
        self.picker = LeastOutstanding()
        self.remote_outstanding = {p.name: 0 for p in remote}
        self.by_name = {p.name: p for p in remote}
        self.busy = False
        self.outstanding = 0
        self._wake_at: float | None = None
        self.link_free = 0.0
        self.transfers = 0
        self.transfer_bytes = 0
        self.batches = 0
        self.batch_sum = 0
        self.items_sum = 0
        self.routed = {"remote": 0, "local": 0}
        self.member = member  # this GPU's rank within its local prefill worker's TP group
        if local is not None:
            local.set_share(*shares.local_share(None, local_active=False), member=member)

    def on_arrival(self, job: Job) -> None:
        self.outstanding += 1
        self.batcher.on_arrival(job, self.loop.now)
        self._kick()

    def apply_knobs(self, change: Any) -> Any:
        """A live knob change (``policies.knobs.KnobChange``), exactly as the live encode worker
        takes it (``apply_knobs``): pending jobs stay queued, the next poll uses the new values."""
        res = apply_knobs(
            self.batcher, self.router, change, has_local=self.local is not None, has_remote=bool(self.remote)
        )
        self.batcher = res.batcher
        self._wake_at = None  # the dispatch deadline may have moved
        self._kick()
        return res

    def _kick(self) -> None:
        if self.busy:
            return
        now = self.loop.now
        d = self.batcher.poll(now)
        if d is None:
            w = self.batcher.next_wakeup(now)
            if w is not None and w != self._wake_at:
                self._wake_at = w
                self.loop.at(w, self._wake, w)
            return
        self._wake_at = None
        jobs: tuple[Job, ...] = d.items
        self.reasons[str(d.reason)] = self.reasons.get(str(d.reason), 0) + 1
        items = sum(j.req.encoder_items for j in jobs)
        local_active = self.local is not None and bool(self.local.batch)
        share, dilation = self.shares.encode_share(items, local_active)
        dt = self.model.encode_s(items, share) * dilation if items else 0.0
        self.busy = True
        self.batches += 1
        self.batch_sum += len(jobs)
        self.items_sum += items
        self.busy_s += dt
        if self.local is not None:
            self.local.set_share(*self.shares.local_share(items, local_active=True), member=self.member)
        self.loop.at(now + dt, self._done, jobs)

    def _wake(self, t: float) -> None:
        if self._wake_at == t:
            self._wake_at = None
            self._kick()

    def _done(self, jobs: tuple[Job, ...]) -> None:
        now = self.loop.now
        self.busy = False
        self.outstanding -= len(jobs)
        if self.local is not None:
            self.local.set_share(*self.shares.local_share(None, local_active=True), member=self.member)
        # route every request, then one envelope per destination
        groups: dict[str, list[Job]] = {}
        for job in jobs:
            route = self.router.decide() if self.router is not None else Route.REMOTE
            if route == Route.LOCAL and self.local is not None:
                job.route = "local"
                self.routed["local"] += 1
                groups.setdefault("local", []).append(job)
                self.local.outstanding += 1
                continue
            job.route = "remote"
            self.routed["remote"] += 1
            for p in self.remote:
                self.remote_outstanding[p.name] = p.outstanding
            name = self.picker.pick([p.name for p in self.remote], self.remote_outstanding)
            self.by_name[name].outstanding += 1
            groups.setdefault(name, []).append(job)
        for dest, group in groups.items():
            if dest == "local":
                assert self.local is not None
                self.local.enqueue(group)
                continue
            nbytes = sum(self.model.embedding_bytes(j.req.media_tokens) for j in group)
            start = max(now, self.link_free)
            self.link_free = start + self.model.transfer_s(nbytes)
            self.transfers += 1
            self.transfer_bytes += nbytes
            self.loop.at(self.link_free, self.by_name[dest].enqueue, group)
        self._kick()
