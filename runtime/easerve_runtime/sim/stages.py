"""The twin's workers in virtual time: encode, local prefill, remote prefill, decode.

Each worker owns a queue and a busy period and charges its latency through the stage model
(``sim/latency.py``, which reads the SAME profile as the runtime's sim engine). Decisions are
never made here; every one is the same object the live worker calls:

- when an encode micro-batch leaves: the batcher (``policies.batcher``);
- encode SMs per micro-batch: the SM policy (``policies.sm_policy``, via ``sim/shares.py``);
- remote vs local, which remote, one envelope per destination: ``policies.post_encode``;
- envelopes in flight before the encoder waits: ``policies.envelope.SendWindow``
  (``spec.encode.sendWindow``);
- which waiting requests form a prefill batch: ``policies.prefill_batch`` (``spec.prefill``);
- which sequences join the decode batch: ``policies.decode_admission`` (``spec.decode``);
- which decode worker gets a KV cache: ``LeastOutstanding``.

What is modelled here is only time: who is busy until when.

Modelling choices (documented in docs/twin.md):
- Embedding transfer follows envelope semantics: one transfer per destination per micro-batch,
  costing ``transfer_s(bytes)`` (setup + bytes/bandwidth), serialised on the encode worker's link;
  the local destination shares the GPU and costs nothing. An envelope holds a slot of the send
  window from its send until it arrives (the live prefill worker acknowledges on receipt); with
  the window full the encoder waits, as the live one does.
- The local prefill worker's speed follows its SM share, which changes whenever its encoder starts
  or finishes a micro-batch: its remaining work is re-timed at every change (progress-based).
- KV handoff costs ``transfer_s(kv_bytes(prompt), path="kv")`` per request, concurrently.
- Decode is continuous batching: requests join at step boundaries, one token per step, step
  time from batch size and the context summed over the batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from easerve_runtime.api import DecodeSpec, EncodeSpec, PrefillSpec
from easerve_runtime.policies.decode_admission import DecodeAdmission
from easerve_runtime.policies.envelope import SendWindow
from easerve_runtime.policies.knobs import apply_knobs
from easerve_runtime.policies.post_encode import LOCAL, PostEncodeRouter
from easerve_runtime.policies.prefill_batch import PrefillBatcher
from easerve_runtime.policies.router import LeastOutstanding
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.mpsshare import MPSSharing
from easerve_runtime.sim.shares import ShareModel
from easerve_runtime.sim.timeslice import TimeSlicing
from easerve_runtime.workload.request import Request, RequestRecord

DEFAULT_PREFILL_TOKEN_BUDGET: int = PrefillSpec().max_batch_tokens
"""``spec.prefill.maxBatchTokens``'s default (the aggregated baseline's token budget too)."""
DEFAULT_MAX_DECODE_SEQS: int = DecodeSpec().max_sequences
"""``spec.decode.maxSequences``'s default."""
DEFAULT_KV_MEMORY_FRACTION: float = DecodeSpec().kv_memory_fraction
DEFAULT_SEND_WINDOW: int = EncodeSpec().send_window


class Job:
    """One request moving through the pipeline, with its record."""

    __slots__ = ("req", "rec", "tokens", "route", "kv_need", "origin", "dest", "queued_s")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.tokens = req.prompt_tokens + req.media_tokens
        self.kv_need = 0.0  # KV bytes reserved at full length (set by the decode worker)
        self.rec = RequestRecord(id=req.id, arrival_s=req.arrival_s, output_tokens=req.output_tokens)
        self.route: str | None = None
        self.origin: PostEncodeRouter[str] | None = None  # the encode worker's router that sent it
        self.dest = ""  # where that router sent it (LOCAL or a remote prefill worker's name)
        self.queued_s = 0.0  # when it entered the queue it waits in now (encode batcher, prefill batcher)


class Busy:
    """Accumulates busy seconds for utilisation; charges the sharing of a GPU that pods share
    (time-slicing, ``sim.timeslice``, or MPS with SM caps, ``sim.mpsshare``)."""

    __slots__ = ("busy_s", "ts", "proc")
    work = ""
    """What this worker runs on the GPU (``encode``, ``prefill``, ``decode``): MPS caps slow each
    kind by its own SM curve."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.ts: TimeSlicing | MPSSharing | None = None
        """Set by ``run_pipeline`` when processes share host GPUs."""
        self.proc = ""
        """This worker's pod replica (``timeslice.pod_key``)."""

    def timesliced(self, dt: float, rows: int = 0, host_s: float = 0.0) -> float:
        """``dt`` of work dispatched now, as its pod pays for it on a time-sliced GPU (the same
        ``dt`` on GPUs of its own); the pod is busy until it ends. ``rows``: a decode step's
        sequences, which pay a per-row term beside capped pods under MPS (``decode_rows_s``).
        ``host_s``: a head of the work on the host's CPU (an encoder's CPU preprocessing), neither
        slowed by the sharing nor holding the GPU: the GPU work ``dt`` starts after it (its factor
        read at dispatch, as every charge here)."""
        if self.ts is None:
            return host_s + dt
        dt *= self.ts.dilation(self.proc, self.work)
        if rows:
            dt += self.ts.decode_rows_s(self.proc, rows)
        now = self.ts.loop.now
        if host_s > 0:
            self.ts.loop.at(now + host_s, self.ts.occupy, self.proc, now + host_s + dt)
        else:
            self.ts.occupy(self.proc, now + dt)
        return host_s + dt


class DecodeWorker(Busy):
    """Continuous batching: every step emits one token for every running sequence."""

    work = "decode"

    def __init__(
        self,
        loop: EventLoop,
        model: StageModel,
        tp: int,
        name: str,
        max_seqs: int = DEFAULT_MAX_DECODE_SEQS,
        kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
    ) -> None:
        super().__init__()
        self.loop, self.model, self.tp, self.name = loop, model, tp, name
        self.admission: DecodeAdmission[Job] = DecodeAdmission(
            max_seqs, model.kv_capacity_bytes(tp, kv_memory_fraction)
        )
        self.finishing: list[tuple[int, int, Job]] = []  # (finish step, seq, job)
        self.ctx_sum = 0  # current context tokens over running sequences
        self.step = 0
        self.stepping = False
        self.outstanding = 0  # routed here and not finished (includes KV in flight)
        self.on_finish: Callable[[Job], None] | None = None
        self._seq = 0
        self.steps = 0
        self.batch_sum = 0
        self._joined: list[Job] = []  # admitted at the step in flight: its end is their second token

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def kv_capacity(self) -> float:
        return self.admission.kv_capacity_bytes

    def admit(self, job: Job) -> None:
        """KV has arrived: the sequence may join at the next step boundary."""
        if not job.kv_need:
            job.kv_need = self.model.kv_bytes(job.tokens + job.req.output_tokens)
        self.admission.add(job, job.kv_need)
        if not self.stepping:
            self._start_step()

    def _start_step(self) -> None:
        for job, _need in self.admission.admit():
            self.ctx_sum += job.tokens + 1
            self._seq += 1
            self._joined.append(job)
            heapq.heappush(self.finishing, (self.step + job.req.output_tokens - 1, self._seq, job))
        n = self.admission.running
        if n == 0:
            self.stepping = False
            return
        self.stepping = True
        step = self.model.decode_step_s(n, self.ctx_sum, self.tp)
        dt = self.timesliced(step + self.model.decode_overhead_s + n * self.model.decode_row_overhead_s, rows=n)
        self.busy_s += dt
        self.steps += 1
        self.batch_sum += n
        self.loop.at(self.loop.now + dt, self._end_step)

    def _end_step(self) -> None:
        now = self.loop.now
        self.step += 1
        self.ctx_sum += self.admission.running
        for job in self._joined:
            job.rec.second_token_s = now
        self._joined.clear()
        f = self.finishing
        while f and f[0][0] <= self.step:
            _, _, job = heapq.heappop(f)
            self.admission.finish(job.kv_need)
            self.ctx_sum -= job.tokens + job.req.output_tokens
            self.outstanding -= 1
            job.rec.finish_s = now
            if self.on_finish is not None:
                self.on_finish(job)
        self._start_step()


class KVHandoff:
    """After prefill: the first token is out; ship the KV cache to the least-loaded decode worker."""

    def __init__(self, loop: EventLoop, model: StageModel, decoders: list[DecodeWorker],
                 same_gpu: Callable[[str | None, str | None], bool] | None = None) -> None:
        self.loop, self.model, self.decoders = loop, model, decoders
        self.same_gpu = same_gpu
        """``same_gpu(sender, decoder)`` (pod replica keys, ``sim.timeslice``): that handoff stays on
        one GPU and goes by CUDA IPC (``engines.kv_ipc``); None: every handoff takes the KV path."""
        self.picker = LeastOutstanding()
        self.outstanding = {d.name: 0 for d in decoders}
        self.by_name = {d.name: d for d in decoders}
        self.on_finish: Callable[[Job], None] | None = None
        self.on_first_token: Callable[[Job], None] | None = None  # the twin's front door (``sim.frontdoor``)
        for d in decoders:
            d.on_finish = self._finished

    def _finished(self, job: Job) -> None:
        if self.on_finish is not None:
            self.on_finish(job)

    def first_token(self, job: Job, sender: str | None = None) -> None:
        now = self.loop.now
        job.rec.first_token_s = now
        if self.on_first_token is not None:
            self.on_first_token(job)
        if job.req.output_tokens <= 1:
            job.rec.finish_s = now
            self._finished(job)
            return
        for d in self.decoders:
            self.outstanding[d.name] = d.outstanding
        name = self.picker.pick([d.name for d in self.decoders], self.outstanding)
        dec = self.by_name[name]
        dec.outstanding += 1
        ipc = self.same_gpu is not None and self.same_gpu(sender, getattr(dec, "proc", None))
        dt = self.model.transfer_s(self.model.kv_bytes(job.tokens), path="kv_ipc" if ipc else "kv")
        self.loop.at(now + dt, dec.admit, job)


class PrefillWorker(Busy):
    """Batched prefill (``PrefillBatcher``); a local worker's speed follows its SM share."""

    work = "prefill"

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
        self.batcher: PrefillBatcher[Job] = PrefillBatcher(token_budget)
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
        self.requests_sum = 0
        self.profile_s = 0.0
        """The profile's time of the batches run, without the GPU's sharing: ``busy_s / profile_s`` is
        the live prefill counters' ``engine_over_profile``."""
        self.wait_s = 0.0
        """Seconds its requests waited in its queue before their batch started, summed: over
        ``requests_sum``, the live prefill counters' ``queue_wait_ms_mean``."""
        self._profiled = False
        self.members: dict[int, tuple[float, float]] = {}
        self.sliced = 1.0
        """The batch in flight's time-slicing factor, fixed when it starts (``Busy.timesliced``)."""

    def _duration(self) -> float:
        if self.local:
            return self._alone() * self.dilation * self.sliced
        return self._alone() * self.sliced

    @property
    def token_budget(self) -> int:
        return self.batcher.max_batch_tokens

    def enqueue(self, jobs: list[Job]) -> None:
        for j in jobs:
            j.queued_s = self.loop.now
            self.batcher.add(j, j.tokens)
        if not self.batch:
            self._start()

    def _start(self) -> None:
        batch, tokens = self.batcher.take()
        if not batch:
            return
        self.batch, self.tokens = batch, tokens
        self.wait_s += sum(self.loop.now - j.queued_s for j in batch)
        self.batches += 1
        self.tokens_sum += tokens
        self.requests_sum += len(batch)
        self._frac_left = 1.0
        self.sliced = self.ts.dilation(self.proc, self.work) if self.ts is not None else 1.0
        self._profiled = False
        self._count_profile()
        self._schedule()

    def _count_profile(self) -> None:
        """The batch's profile time at the first share it runs with, as the live worker's
        ``easerve_prefill_profile_seconds`` counts it at the share it was granted (a batch that
        starts paused, at a zero share, is counted when the split gives it SMs)."""
        if not self._profiled and self.share > 0:
            self.profile_s += self._alone()
            self._profiled = True

    def _alone(self) -> float:
        """The profile's time of the batch in flight at its SM share, without the GPU's sharing."""
        n = len(self.batch)
        if self.local:
            return self.model.local_prefill_s(self.tokens, self.share, n, self.tp)
        return self.model.prefill_s(self.tokens, self.tp, 1.0, n)

    def _schedule(self) -> None:
        """(Re)time the batch in flight from its remaining fraction at the current share."""
        now = self.loop.now
        self._seg_start = now
        self._seg_dur = self._duration()
        self._version += 1
        if self._seg_dur != float("inf"):  # a zero share pauses the batch until the split changes
            self.loop.at(now + self._frac_left * self._seg_dur, self._done, self._version)
            if self.ts is not None:
                self.ts.occupy(self.proc, now + self._frac_left * self._seg_dur)

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
            self._count_profile()
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
            if job.origin is not None:
                job.origin.prefilled(job.dest)
            self.handoff.first_token(job, getattr(self, "proc", None))
        self._start()


class EncodeWorker(Busy):
    """One encode GPU: the real batcher decides dispatch, the real split policy the SM share,
    the real post-encode router where each request goes, the real send window when it waits."""

    work = "encode"

    def __init__(
        self,
        loop: EventLoop,
        model: StageModel,
        shares: ShareModel,
        batcher: Any,
        name: str,
        router: PostEncodeRouter[str],
        remote: list[PrefillWorker],
        local: PrefillWorker | None,
        reasons: dict[str, int],
        member: int = 0,
        send_window: int = DEFAULT_SEND_WINDOW,
    ) -> None:
        super().__init__()
        self.loop, self.model, self.shares, self.batcher, self.name = loop, model, shares, batcher, name
        self.router, self.remote, self.local, self.reasons = router, remote, local, reasons
        self.remote_names = [p.name for p in remote]
        self.by_name = {p.name: p for p in remote}
        self.window = SendWindow(send_window)
        self._outbox: deque[tuple[str, list[Job]]] = deque()
        self.busy = False
        self.outstanding = 0
        self._wake_at: float | None = None
        self.link_free = 0.0
        self.transfers = 0
        self.transfer_bytes = 0
        self.batches = 0
        self.batch_sum = 0
        self.items_sum = 0
        self.profile_s = 0.0
        """The profile's time of the micro-batches run (items, SM share), without the GPU's sharing:
        ``busy_s / profile_s`` is the live encode counters' ``engine_over_profile``."""
        self.wait_s = 0.0
        """Seconds its requests waited in the batcher before their micro-batch was dispatched, summed:
        per request, the live encode counters' ``queue_wait_ms_mean``."""
        self.window_waits = 0
        self.member = member  # this GPU's rank within its local prefill worker's TP group
        if local is not None:
            local.set_share(*shares.local_share(None, local_active=False), member=member)

    @property
    def routed(self) -> dict[str, int]:
        return {"remote": self.router.remote_count, "local": self.router.local_count}

    def on_arrival(self, job: Job) -> None:
        job.queued_s = self.loop.now
        self.outstanding += 1
        self.batcher.on_arrival(job, self.loop.now)
        self._kick()

    def apply_knobs(self, change: Any) -> Any:
        """A live knob change (``policies.knobs.KnobChange``), exactly as the live encode worker
        takes it (``apply_knobs``): pending jobs stay queued, the next poll uses the new values."""
        res = apply_knobs(
            self.batcher, self.router.deficit, change, has_local=self.local is not None, has_remote=bool(self.remote)
        )
        self.batcher = res.batcher
        self._wake_at = None  # the dispatch deadline may have moved
        self._kick()
        return res

    def _kick(self) -> None:
        if self.busy or self._outbox:  # encoding, or waiting for the send window (as live)
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
        self.wait_s += sum(now - j.queued_s for j in jobs)
        items = sum(j.req.encoder_items for j in jobs)
        local_active = self.local is not None and bool(self.local.batch)
        share, dilation = self.shares.encode_share(items, local_active)
        alone = self.model.encode_s(items, share) if items else 0.0
        host = min(alone, self.model.encode_host_s(items))  # CPU preprocessing: no SMs, no GPU held
        dt = self.timesliced((alone - host) * dilation, host_s=host) if items else 0.0
        self.profile_s += alone  # as the live worker's easerve_encode_profile_seconds_total
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
        self.busy = False
        self.outstanding -= len(jobs)
        if self.local is not None:
            self.local.set_share(*self.shares.local_share(None, local_active=True), member=self.member)
        plan = self.router.route(jobs, self.remote_names)
        if plan.unroutable:  # the twin builds no such worker (run_pipeline rejects it)
            raise ValueError(f"{self.name}: REMOTE route with no remote prefill worker")
        for dest, group in plan.groups.items():
            for job in group:
                job.route = "local" if dest == LOCAL else "remote"
                job.origin, job.dest = self.router, str(dest)
                if dest == LOCAL:
                    assert self.local is not None
                    self.local.outstanding += 1
                else:
                    self.by_name[str(dest)].outstanding += 1
            self._outbox.append((str(dest), group))
        self._flush()
        self._kick()

    def _flush(self) -> None:
        """Send queued envelopes while the window has room (FIFO, as the live worker awaits them)."""
        now = self.loop.now
        while self._outbox:
            if not self.window.try_acquire():
                self.window_waits += 1
                return
            dest, group = self._outbox.popleft()
            if dest == LOCAL:  # same GPU: no transfer, acknowledged at once
                self.window.release()
                assert self.local is not None
                self.local.enqueue(group)
                continue
            nbytes = sum(self.model.embedding_bytes(j.req.media_tokens) for j in group)
            start = max(now, self.link_free)
            self.link_free = start + self.model.transfer_s(nbytes)
            self.transfers += 1
            self.transfer_bytes += nbytes
            self.loop.at(self.link_free, self._arrived, dest, group)

    def _arrived(self, dest: str, group: list[Job]) -> None:
        """The envelope reached its prefill worker, which acknowledges it: a window slot frees."""
        self.window.release()
        self.by_name[dest].enqueue(group)
        if self._outbox:
            self._flush()
        self._kick()
