"""The decode worker: continuous batching of sequences handed over by prefill, tokens streamed back.

Sequences join the running batch between any two steps (after their KV cache has been
received) and leave when they reach ``max_tokens``; each step is one engine call over the whole
running batch, capped at ``MAX_BATCH`` sequences.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from easerve_runtime.engines.base import DecodeEngine, DecodeSequence, Sampling, SlotDecodeEngine
from easerve_runtime.metrics import Metrics
from easerve_runtime.workers.wire import b64d

log = logging.getLogger("easerve.decode")

MAX_BATCH = 128
"""Most sequences per decode step (no spec field yet)."""


class DecodeWorker:
    stage = "decode"

    def __init__(self, engine: DecodeEngine, metrics: Metrics, *, max_batch: int = MAX_BATCH) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch = max_batch
        self._waiting: deque[tuple[DecodeSequence, asyncio.Queue[Any]]] = deque()
        self._running: list[tuple[DecodeSequence, asyncio.Queue[Any]]] = []
        self._arrival = asyncio.Event()
        self._kv_in: dict[str, dict[int, bytes]] = {}
        self.stop_token_ids: tuple[int, ...] = tuple(getattr(engine, "stop_token_ids", ()))
        self.slots: SlotDecodeEngine | None = engine if isinstance(engine, SlotDecodeEngine) else None

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if "kv_chunk" in request:  # a piece of a KV cache that a request will claim (see wire.py)
            try:
                c = request["kv_chunk"]
                self._kv_in.setdefault(str(c["id"]), {})[int(c["seq"])] = b64d(c["b64"])
            except (KeyError, ValueError, TypeError) as exc:
                yield {"error": f"decode: bad KV chunk: {exc}"}
                return
            yield {"ack": True}
            return
        try:
            rid = str(request["id"])
            kv = None
            if "kv_chunks" in request:
                got = self._kv_in.pop(rid, {})
                n = int(request["kv_chunks"])
                if sorted(got) != list(range(n)):
                    raise ValueError(f"KV cache of {rid}: received chunks {sorted(got)} of {n}")
                kv = b"".join(got[i] for i in range(n))
            seq = DecodeSequence(
                request_id=rid,
                context_tokens=int(request["context_tokens"]),
                max_tokens=int(request["max_tokens"]),
                seed=int(request.get("seed", 0)),
                generated=[int(request["first_token"])],
                stop_token_ids=self.stop_token_ids,
                sampling=Sampling.from_wire(request),
                kv=kv,
                kv_meta=dict(request.get("kv_meta") or {}),
            )
            kv_bytes = int(request.get("kv_bytes", 0))
        except (KeyError, ValueError, TypeError) as exc:
            yield {"error": f"decode: bad request: {exc}"}
            return
        await self.engine.receive_kv(kv_bytes)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._waiting.append((seq, q))
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
        if ok and seq.stopped:
            yield {"finish_reason": "stop"}
        self.metrics.stage_requests.labels(self.stage, "ok" if ok else "error").inc()

    def _gauges(self) -> None:
        self.metrics.queue_depth.labels(self.stage).set(len(self._waiting))
        self.metrics.inflight.labels(self.stage).set(len(self._waiting) + len(self._running))

    async def run(self) -> None:
        while True:
            while self._waiting and len(self._running) < self.max_batch:
                seq, q = self._waiting[0]
                if seq.done:
                    self._waiting.popleft()
                    q.put_nowait(None)
                    continue
                if self.slots is not None:  # KV memory is bounded: wait for a slot, never overcommit
                    if not self.slots.can_admit(seq):
                        break
                    try:
                        await self.slots.admit(seq)
                    except Exception as exc:
                        self._waiting.popleft()
                        q.put_nowait(exc)
                        continue
                self._waiting.popleft()
                self._running.append((seq, q))
            self._gauges()
            if not self._running:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            batch = [s for s, _ in self._running]
            self.metrics.decode_batch_size.observe(len(batch))
            try:
                tokens = await self.engine.decode_step(batch)
            except Exception as exc:
                log.exception("decode step failed")
                for s, q in self._running:
                    q.put_nowait(exc)
                    self._release(s)
                self._running.clear()
                continue
            still: list[tuple[DecodeSequence, asyncio.Queue[Any]]] = []
            for (seq, q), tok in zip(self._running, tokens, strict=True):
                seq.generated.append(tok)
                q.put_nowait(tok)
                if seq.done:
                    q.put_nowait(None)
                    self._release(seq)
                else:
                    still.append((seq, q))
            self._running = still

    def _release(self, seq: DecodeSequence) -> None:
        if self.slots is not None:
            self.slots.release(seq.request_id)
