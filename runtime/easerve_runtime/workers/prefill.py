"""The prefill worker (remote pool, or the local one sharing an encode GPU): same code, two names.

It receives envelopes, acknowledges each as soon as it is unpacked (that frees a slot of the
sender's window), batches queued requests up to a token budget, prefills them, streams each
request's first token back at once, then hands the KV cache to the decode worker with the fewest
outstanding requests and relays its tokens. Responses of all requests in an envelope are
multiplexed on that envelope's stream, tagged with the request id.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from easerve_runtime.engines.base import PrefillEngine, PrefillInput, PrefillOutput
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.envelope import Envelope
from easerve_runtime.workers.partition_link import PartitionLink
from easerve_runtime.workers.pool import StageError, StagePool
from easerve_runtime.workers.wire import b64d

log = logging.getLogger("easerve.prefill")

MAX_BATCH_TOKENS = 16384
"""Most prompt tokens prefilled in one engine call (no spec field yet)."""


class PrefillWorker:
    def __init__(
        self,
        engine: PrefillEngine,
        metrics: Metrics,
        decode: StagePool,
        *,
        stage: str = "prefill",
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        sm_share: Callable[[], float] | None = None,
        partition: PartitionLink | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.decode = decode
        self.stage = stage
        self.max_batch_tokens = max_batch_tokens
        self.sm_share = sm_share or (lambda: 1.0)
        self.partition = partition
        self._pending: deque[tuple[dict[str, Any], asyncio.Queue[dict[str, Any]]]] = deque()
        self._arrival = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight = 0

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet handed on (the local prefill's drain waits for 0)."""
        return self._inflight

    async def generate(self, envelope: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            metas = list(envelope["requests"])
            arrays = Envelope.unpack(b64d(envelope["buffer"]), envelope["index"])
            for meta in metas:
                if meta["mm_tokens"] and meta["id"] not in arrays:
                    raise ValueError(f"request {meta['id']} has no embedding in the envelope")
        except (KeyError, ValueError, TypeError) as exc:
            # answer every request we can name, so none of them hangs at the sender
            for meta in envelope.get("requests", []) if isinstance(envelope, dict) else []:
                yield {"id": meta.get("id"), "error": f"{self.stage}: bad envelope: {exc}"}
            return
        yield {"ack": True}
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for meta in metas:
            self._pending.append((meta, q))
        self._inflight += len(metas)
        self._gauges()
        self._arrival.set()
        remaining = len(metas)
        while remaining:
            item = await q.get()
            if item.get("done") or "error" in item:
                remaining -= 1
                self._inflight -= 1
                self.metrics.stage_requests.labels(self.stage, "error" if "error" in item else "ok").inc()
                self._gauges()
            yield item

    def _gauges(self) -> None:
        self.metrics.queue_depth.labels(self.stage).set(len(self._pending))
        self.metrics.inflight.labels(self.stage).set(self._inflight)

    async def run(self) -> None:
        while True:
            if not self._pending:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            batch: list[tuple[dict[str, Any], asyncio.Queue[dict[str, Any]]]] = []
            tokens = 0
            while self._pending:
                meta, q = self._pending[0]
                t = int(meta["text_tokens"]) + int(meta["mm_tokens"])
                if batch and tokens + t > self.max_batch_tokens:
                    break
                self._pending.popleft()
                batch.append((meta, q))
                tokens += t
            self._gauges()
            inputs = [
                PrefillInput(m["id"], int(m["text_tokens"]), int(m["mm_tokens"]), int(m["seed"]))
                for m, _ in batch
            ]
            share = self.partition.share(len(inputs)) if self.partition is not None else self.sm_share()
            try:
                outs = await self.engine.prefill(inputs, share)
            except Exception as exc:
                log.exception("prefill batch failed")
                if self.partition is not None:
                    self.partition.idle()
                for m, q in batch:
                    q.put_nowait({"id": m["id"], "error": f"{self.stage} failed: {exc}"})
                continue
            if self.partition is not None and not self._pending:
                self.partition.idle()
            for (meta, q), out in zip(batch, outs, strict=True):
                q.put_nowait({"id": meta["id"], "token": out.first_token})
                if int(meta["max_tokens"]) <= 1:
                    q.put_nowait({"id": meta["id"], "done": True})
                    continue
                task = asyncio.create_task(self._handoff(meta, out, q))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _handoff(
        self, meta: dict[str, Any], out: PrefillOutput, q: asyncio.Queue[dict[str, Any]]
    ) -> None:
        rid = meta["id"]
        req = {
            "id": rid,
            "seed": int(meta["seed"]),
            "context_tokens": int(meta["text_tokens"]) + int(meta["mm_tokens"]),
            "max_tokens": int(meta["max_tokens"]),
            "first_token": out.first_token,
            "kv_bytes": out.kv_bytes,
            "priority": int(meta.get("priority", 0)),
        }
        expected = int(meta["max_tokens"]) - 1
        got = 0
        try:
            async for item in self.decode.stream(req):
                if "error" in item:
                    raise StageError(str(item["error"]))
                got += 1
                q.put_nowait({"id": rid, "token": item["token"]})
            if got != expected:
                raise StageError(f"decode stream ended after {got} of {expected} tokens")
            q.put_nowait({"id": rid, "done": True})
        except StageError as exc:
            q.put_nowait({"id": rid, "error": str(exc)})
        except Exception as exc:  # never leave a request hanging
            log.exception("handoff failed")
            q.put_nowait({"id": rid, "error": f"decode handoff failed: {exc}"})
