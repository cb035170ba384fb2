"""The decode worker: continuous batching of sequences handed over by prefill, tokens streamed back.

Sequences join the running batch between any two steps (after their KV cache has been
received) and leave when they reach ``max_tokens``; each step is one engine call over the whole
running batch. Who joins is decided by the shared admission policy
(``policies.decode_admission.DecodeAdmission``, ``spec.decode``; the twin uses the same object):
at most ``maxSequences`` running, and a sequence joins only when its KV cache at full length
(prompt + ``max_tokens``) fits in the worker's KV capacity next to the running ones' reservations.
A sequence that does not fit waits (its client sees a later first decode token), never OOMs.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from easerve_runtime.api import DecodeSpec, EPDDeploymentSpec
from easerve_runtime.engines.base import DecodeEngine, DecodeSequence
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.decode_admission import DecodeAdmission

log = logging.getLogger("easerve.decode")

Entry = tuple[DecodeSequence, "asyncio.Queue[Any]", float]  # (sequence, its token queue, KV need)


class DecodeWorker:
    stage = "decode"

    def __init__(
        self,
        engine: DecodeEngine,
        metrics: Metrics,
        *,
        admission: DecodeAdmission[Entry] | None = None,
        kv_bytes: Callable[[int], float] | None = None,
    ) -> None:
        """``admission``: the shared policy, built from ``spec.decode`` and this worker's KV capacity
        (default: the spec defaults with unbounded memory, for tests); ``kv_bytes(tokens)``: the KV
        cache of one sequence of ``tokens`` (the profile's), to reserve each at full length."""
        self.engine = engine
        self.metrics = metrics
        self.admission: DecodeAdmission[Entry] = admission or DecodeAdmission(
            DecodeSpec().max_sequences, math.inf
        )
        self.kv_bytes = kv_bytes or (lambda tokens: 0.0)
        self._running: list[Entry] = []
        self._arrival = asyncio.Event()

    @classmethod
    def for_spec(cls, spec: EPDDeploymentSpec, engine: DecodeEngine, metrics: Metrics) -> DecodeWorker:
        """The decode worker of a deployment: ``spec.decode``'s admission over this worker's KV
        capacity, from the engine when it reports one (``kv_capacity_bytes(memory_fraction)``),
        else from the latency profile (``kv_budget_bytes(tp, memory_fraction)``), the same figure
        the twin admits by."""
        d = spec.decode
        profile = getattr(engine, "profile", None)
        if not (
            callable(getattr(profile, "kv_budget_bytes", None))
            and callable(getattr(profile, "kv_bytes", None))
        ):
            from easerve_runtime.profiles import load_profile

            profile = load_profile(spec.engine.profile)
        report = getattr(engine, "kv_capacity_bytes", None)
        if callable(report):
            capacity = float(report(d.kv_memory_fraction))
        else:
            capacity = float(
                profile.kv_budget_bytes(spec.allocation.decode.tensor_parallel, d.kv_memory_fraction)
            )
        return cls(
            engine, metrics, admission=DecodeAdmission.for_spec(d, capacity), kv_bytes=profile.kv_bytes
        )

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            seq = DecodeSequence(
                request_id=str(request["id"]),
                context_tokens=int(request["context_tokens"]),
                max_tokens=int(request["max_tokens"]),
                seed=int(request.get("seed", 0)),
                generated=[int(request["first_token"])],
            )
            kv_bytes = int(request.get("kv_bytes", 0))
        except (KeyError, ValueError, TypeError) as exc:
            yield {"error": f"decode: bad request: {exc}"}
            return
        await self.engine.receive_kv(kv_bytes)
        q: asyncio.Queue[Any] = asyncio.Queue()
        need = float(self.kv_bytes(seq.context_tokens + seq.max_tokens))
        self.admission.add((seq, q, need), need)
        self._gauges()
        self._arrival.set()
        ok = True
        while True:
            item = await q.get()
            if item is None:
                break
            if isinstance(item, Exception):
                ok = False
                yield {"error": f"decode failed: {item}"}
                break
            yield {"token": item}
        self.metrics.stage_requests.labels(self.stage, "ok" if ok else "error").inc()

    def _gauges(self) -> None:
        waiting = self.admission.waiting
        self.metrics.queue_depth.labels(self.stage).set(waiting)
        self.metrics.inflight.labels(self.stage).set(waiting + len(self._running))

    async def run(self) -> None:
        while True:
            for entry, need in self.admission.admit():
                seq, q, _ = entry
                if seq.done:
                    q.put_nowait(None)
                    self.admission.finish(need)
                else:
                    self._running.append(entry)
            self._gauges()
            if not self._running:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            batch = [s for s, _, _ in self._running]
            self.metrics.decode_batch_size.observe(len(batch))
            try:
                tokens = await self.engine.decode_step(batch)
            except Exception as exc:
                log.exception("decode step failed")
                for _s, q, need in self._running:
                    q.put_nowait(exc)
                    self.admission.finish(need)
                self._running.clear()
                continue
            still: list[Entry] = []
            for entry, tok in zip(self._running, tokens, strict=True):
                seq, q, need = entry
                seq.generated.append(tok)
                q.put_nowait(tok)
                if seq.done:
                    q.put_nowait(None)
                    self.admission.finish(need)
                else:
                    still.append(entry)
            self._running = still
