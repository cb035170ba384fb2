"""The vLLM-style aggregated baseline: every GPU group runs encode, prefill and decode itself.

Each replica (``tp`` GPUs) runs one engine loop, as vLLM's scheduler does:

- every iteration decodes one token for every running sequence (continuous batching);
- waiting requests are admitted FIFO while KV memory and the sequence cap allow, and prefilled
  in chunks that fill the iteration's token budget (max_num_batched_tokens, decode tokens
  included: vLLM's chunked prefill); a request's media are encoded inline, before its first
  chunk, in the same iteration;
- a mixed iteration costs ``encode + max(prefill(new + running tokens), decode step)``: one fused
  forward pass streams the weights once, so its time is the larger of its compute-bound prefill
  part and its bandwidth-bound decode part. That is the generous reading (vLLM's chunked prefill
  gets close to it); we give the baseline its best case. A profile measured on an engine that
  does not fuse says so (``engine.mixed_iteration: sequential``, the torch engine's aggregated
  worker): it prefills whole prompts (the planner's ``chunked=False``), then steps decode, and
  the iteration costs ``encode + prefill + decode step``. Either way each iteration that decodes
  pays the profile's measured ``decode_loop_overhead_ms`` (0 for a modelled profile), and encode
  and prefill are charged at the served aggregated worker's own cost per request where the
  profile carries it (``engine.aggregated``, read off a low-load run's loop counters: the worker
  encodes and prefills one request at a time inside its loop, which the per-stage points, timed
  on the engines' calls, leave out).
- The vision/audio encoder is sharded over the replica's ``tp`` GPUs (vLLM uses tensor-parallel
  layers in its encoders), charged as encoding ⌈items/tp⌉ on one GPU.

The admission and chunk planning is ``policies.aggregated.AggregatedPlanner``, the same object the
live aggregated worker (``workers/aggregated.py``, ``spec.mode: aggregated``) runs; only the timing
is modelled here.

Requests are spread over replicas by fewest outstanding. The best (tp, replicas) layout for the
GPU budget, and the best token budget (2048 or 8192: small chunks protect TPOT, large ones TTFT),
are chosen by sweeping (``systems.best_of``), never assumed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from easerve_runtime.policies.aggregated import AggregatedPlanner
from easerve_runtime.policies.router import LeastOutstanding
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.stages import DEFAULT_MAX_DECODE_SEQS, DEFAULT_PREFILL_TOKEN_BUDGET, Job
from easerve_runtime.workload.request import Request


class AggregatedReplica:
    """One aggregated engine in virtual time; its iterations are planned by ``AggregatedPlanner``
    (``policies.aggregated``), the object the live aggregated worker runs too."""

    def __init__(
        self,
        loop: EventLoop,
        model: StageModel,
        tp: int,
        name: str,
        token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
        max_seqs: int = DEFAULT_MAX_DECODE_SEQS,
    ) -> None:
        # the worker's own encode and prefill per request where the profile measured them (engine.aggregated)
        self.loop, self.model, self.tp, self.name = loop, model.aggregated_loop(), tp, name
        self.token_budget, self.max_seqs = token_budget, max_seqs
        self.kv_capacity = self.model.kv_capacity_bytes(tp)
        self.sequential = self.model.mixed_iteration == "sequential"
        self.planner: AggregatedPlanner[Job] = AggregatedPlanner(
            token_budget, max_seqs, self.kv_capacity, chunked=not self.sequential
        )
        self.finishing: list[tuple[int, int, Job]] = []
        self.ctx_sum = 0
        self.step = 0
        self.stepping = False
        self.outstanding = 0
        self.busy_s = 0.0
        self.encode_s = 0.0
        self.prefill_s = 0.0
        self.iterations = 0
        self.items_sum = 0
        self.tokens_sum = 0
        self.decoded = 0
        self._seq = 0

    @property
    def running(self) -> int:
        return self.planner.running

    def arrive(self, job: Job) -> None:
        self.outstanding += 1
        job.kv_need = self.model.kv_bytes(job.tokens + job.req.output_tokens)
        self.planner.add(job, job.tokens, job.kv_need)
        if not self.stepping:
            self._iterate()

    def _iterate(self) -> None:
        """Time one engine iteration the planner cut: decode every running sequence, prefill its
        chunks (a request's encode runs with its first chunk)."""
        it = self.planner.plan()
        if it.empty:
            self.stepping = False
            return
        self.stepping = True
        chunks = [(c.item, c.last) for c in it.chunks]
        items = sum(c.item.req.encoder_items for c in it.chunks if c.first)
        tokens, n = it.tokens, it.decodes
        m = self.model
        enc = m.encode_s(-(-items // self.tp), 1.0) if items else 0.0
        prefill = 0.0
        if chunks and n and self.sequential:
            prefill = m.prefill_s(tokens, self.tp, 1.0, len(chunks))
            dt = enc + prefill + m.decode_step_s(n, self.ctx_sum, self.tp)
        elif chunks and n:
            prefill = m.prefill_s(tokens + n, self.tp, 1.0, len(chunks) + n)
            dt = enc + max(prefill, m.decode_step_s(n, self.ctx_sum, self.tp))
        elif chunks:
            prefill = m.prefill_s(tokens, self.tp, 1.0, len(chunks))
            dt = enc + prefill
        else:
            dt = m.decode_step_s(n, self.ctx_sum, self.tp)
        if n:
            dt += m.decode_overhead_s
        self.items_sum += items
        self.tokens_sum += tokens
        self.decoded += n
        self.busy_s += dt
        self.encode_s += enc
        self.prefill_s += prefill
        self.iterations += 1
        self.loop.at(self.loop.now + dt, self._end, chunks)

    def _end(self, chunks: list[tuple[Job, bool]]) -> None:
        now = self.loop.now
        self.step += 1
        self.ctx_sum += self.running
        f = self.finishing
        while f and f[0][0] <= self.step:
            _, _, job = heapq.heappop(f)
            self._finish(job, now)
        for job, last in chunks:
            if not last:
                continue
            decodes = job.req.output_tokens > 1
            self.planner.prefilled(job.kv_need, decodes)
            job.rec.first_token_s = now
            if not decodes:
                self.outstanding -= 1
                job.rec.finish_s = now
                continue
            self.ctx_sum += job.tokens + 1
            self._seq += 1
            heapq.heappush(f, (self.step + job.req.output_tokens - 1, self._seq, job))
        self._iterate()

    def _finish(self, job: Job, now: float) -> None:
        self.planner.finish(job.kv_need)
        self.ctx_sum -= job.tokens + job.req.output_tokens
        self.outstanding -= 1
        job.rec.finish_s = now


def run_aggregated(
    requests: Sequence[Request],
    model: StageModel,
    tp: int,
    replicas: int,
    token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
) -> tuple[list[Job], dict[str, Any]]:
    """Replay ``requests`` over ``replicas`` aggregated engines of ``tp`` GPUs each."""
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    loop = EventLoop()
    reps = [AggregatedReplica(loop, model, tp, f"replica-{i}", token_budget) for i in range(replicas)]
    picker = LeastOutstanding()
    names = [r.name for r in reps]
    by_name = {r.name: r for r in reps}
    outstanding = {n: 0 for n in names}
    jobs = [Job(r) for r in requests]

    def arrive(job: Job) -> None:
        for r in reps:
            outstanding[r.name] = r.outstanding
        by_name[picker.pick(names, outstanding)].arrive(job)

    for job in jobs:
        loop.at(job.req.arrival_s + model.request_path_s, arrive, job)
    loop.run()
    horizon = max((j.rec.finish_s or 0.0) for j in jobs) - min((j.req.arrival_s for j in jobs), default=0.0)
    busy = sum(r.busy_s for r in reps)
    stats: dict[str, Any] = {
        "utilisation": {"replica": (busy / (replicas * horizon)) if horizon > 0 else None},
        "encode_share_of_busy": (sum(r.encode_s for r in reps) / busy) if busy > 0 else 0.0,
        "encode_s": sum(r.encode_s for r in reps),
        "prefill_s": sum(r.prefill_s for r in reps),
        "iterations": sum(r.iterations for r in reps),
        "encoded_items": sum(r.items_sum for r in reps),
        "prefilled_tokens": sum(r.tokens_sum for r in reps),
        "decoded_tokens": sum(r.decoded for r in reps),
        "dispatch_reasons": {},
        "routed": {},
        "events": loop.events,
    }
    return jobs, stats
