"""HAS's stage profiler on the twin: per-worker capacities under a stress workload for each stage.

Every probe runs the twin's own worker class in isolation on a sample of the deployment's
workload with all requests queued at t = 0 (the stress workload), and reports requests/s plus
the virtual time the measurement took (``cost_s``: what a real profiling run would cost):

- ``encode_throughput(B)``: one encode worker (TP 1, full GPU) encoding the sample in back-to-back
  micro-batches of B requests. ``encode_capacity()`` doubles B from 1 until the gain is < 5%
  and returns C_E (the paper's saturation capacity) with the curve.
- ``prefill_capacity(tp)``: one remote prefill worker (token-budget batches).
- ``decode_capacity(tp)``: one decode worker (continuous batching, KV-bounded).
- ``local_prefill_efficiency()``: α, the local worker's capacity at its SM share (the partner
  share for a B-sized micro-batch under the spec's partition mode) over C_P, both at the
  smallest TP that fits (a local worker of TP k spans k encode GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.sim.allocations import feasible_tps
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.shares import ShareModel
from easerve_runtime.sim.stages import DecodeWorker, Job, KVHandoff, PrefillWorker
from easerve_runtime.workload.generate import generate

SATURATION_GAIN = 0.05
MAX_BATCH = 256


@dataclass(frozen=True)
class Probe:
    """A capacity (requests/s) and the device time its measurement took (seconds)."""

    value: float
    cost_s: float = 0.0


class SimProfiler:
    """``Profiler`` for HAS Stage 1, answered by the twin's workers on the spec's workload."""

    def __init__(
        self, spec: EPDDeploymentSpec, n_requests: int = 256, seed: int = 0, model: Any = None
    ) -> None:
        self.spec = spec
        self.model: StageModel = model if model is not None else cached_model(spec)
        self.requests = generate(spec, 1.0, n_requests, seed)

    def min_tp(self) -> int:
        tps = feasible_tps(self.model)
        if not tps:
            raise ValueError("spec.engine.profile: the backbone fits no TP degree in {1, 2, 4, 8}")
        return tps[0]

    def encode_throughput(self, batch: int, sm_share: float = 1.0) -> Probe:
        if batch < 1:
            raise ValueError(f"batch: must be >= 1, got {batch}")
        reqs = self.requests
        total = 0.0
        for i in range(0, len(reqs), batch):
            items = sum(r.encoder_items for r in reqs[i : i + batch])
            total += self.model.encode_s(items, sm_share) if items else 0.0
        return Probe(len(reqs) / total if total > 0 else float("inf"), total)

    def encode_capacity(self) -> tuple[float, int, list[tuple[int, float]]]:
        """(C_E, B at saturation, [(B, req/s), ...]) by doubling B until the gain is < 5%."""
        curve: list[tuple[int, float]] = []
        b = 1
        best = self.encode_throughput(1).value
        curve.append((1, best))
        while b < MAX_BATCH:
            nb = b * 2
            v = self.encode_throughput(nb).value
            curve.append((nb, v))
            if v < best * (1 + SATURATION_GAIN):
                return max(best, v), b if v <= best else nb, curve
            best, b = v, nb
        return best, b, curve

    def _prefill(self, tp: int, local_share: float | None) -> Probe:
        loop = EventLoop()
        handoff = KVHandoff(loop, self.model, [])
        done: list[float] = []

        def first_token(job: Job, sender: str | None = None) -> None:
            done.append(loop.now)

        handoff.first_token = first_token  # type: ignore[method-assign]
        w = PrefillWorker(
            loop,
            self.model,
            tp,
            "probe",
            handoff,
            local=local_share is not None,
            token_budget=self.spec.prefill.max_batch_tokens,
        )
        if local_share is not None:
            w.set_share(local_share)
        w.enqueue([Job(r) for r in self.requests])
        loop.run()
        t = max(done) if done else 0.0
        return Probe(len(self.requests) / t if t > 0 else float("inf"), t)

    def prefill_capacity(self, tp: int) -> Probe:
        return self._prefill(tp, None)

    def decode_capacity(self, tp: int) -> Probe:
        loop = EventLoop()
        d = self.spec.decode
        w = DecodeWorker(loop, self.model, tp, "probe", d.max_sequences, d.kv_memory_fraction)
        jobs = [Job(r) for r in self.requests]
        w.stepping = True  # queue them all before the first step
        for j in jobs:
            w.outstanding += 1
            w.admit(j)
        w._start_step()
        loop.run()
        t = max((j.rec.finish_s or 0.0) for j in jobs)
        return Probe(len(jobs) / t if t > 0 else float("inf"), t)

    def local_share(self) -> float:
        """The local worker's SM share while a B-sized micro-batch encodes (spec's partition mode)."""
        spec = self.spec
        if spec.offload.ratio >= 1.0:
            spec = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 0.5})})
        shares = ShareModel(spec, self.model, colocated=True)
        mean_items = sum(r.encoder_items for r in self.requests) / len(self.requests)
        share, dilation = shares.local_share(max(1, round(mean_items * spec.encode.batch_bound)), True)
        return share / dilation

    def local_prefill_capacity(self, share: float) -> Probe:
        """One local prefill worker (TP = ``min_tp()``, spanning that many encode GPUs) at ``share``."""
        return self._prefill(self.min_tp(), max(share, 1e-3))

    def local_prefill_efficiency(self) -> float | None:
        tp = self.min_tp()
        c_p = self.prefill_capacity(tp).value
        local = self._prefill(tp, max(self.local_share(), 1e-3)).value
        return local / c_p if c_p > 0 else None
