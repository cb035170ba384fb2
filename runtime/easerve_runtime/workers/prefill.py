"""The prefill worker (remote pool, or the local one sharing an encode GPU): same code, two names.

It receives envelopes, acknowledges each as soon as it is unpacked (that frees a slot of the
sender's window), batches queued requests with the shared prefill batching policy
(``policies.prefill_batch.PrefillBatcher``, ``spec.prefill.maxBatchTokens``: the twin uses the
same object), prefills them, streams each
request's first token back at once, then hands the KV cache to the decode worker with the fewest
outstanding requests and relays its tokens. Responses of all requests in an envelope are
multiplexed on that envelope's stream, tagged with the request id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from easerve_runtime.api import PrefillSpec
from easerve_runtime.engines.base import PrefillEngine, PrefillInput, PrefillOutput, Sampling
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.envelope import Envelope
from easerve_runtime.policies.prefill_batch import PrefillBatcher
from easerve_runtime.workers.blobs import HostBlobs
from easerve_runtime.workers.partition_link import PartitionLink
from easerve_runtime.workers.pool import StageError, StagePool
from easerve_runtime.workers.wire import b64d, b64e

log = logging.getLogger("easerve.prefill")

Pending = tuple[dict[str, Any], "asyncio.Queue[dict[str, Any]]"]
KV_CHUNK_BYTES = 4 << 20
"""KV cache bytes per request-plane message to decode (4 MiB: well under Dynamo's TCP message cap)."""
KV_CHUNKS_IN_FLIGHT = 4
IPC_OUTSTANDING_ENV = "EASERVE_KV_IPC_OUTSTANDING"
IPC_MAX_OUTSTANDING = 8
"""Same-GPU KV shares (``engines.kv_ipc``) a prefill worker keeps offered at once; more go by host
copy. Eight 7B caches of 2,560 tokens are 2.6 GB of this GPU's memory; decode copies each into one
of its staging buffers (``EASERVE_KV_STAGE``, 4) as they free up."""


class PrefillWorker:
    def __init__(
        self,
        engine: PrefillEngine,
        metrics: Metrics,
        decode: StagePool,
        *,
        stage: str = "prefill",
        max_batch_tokens: int = PrefillSpec().max_batch_tokens,
        sm_share: Callable[[], float] | None = None,
        partition: PartitionLink | None = None,
        profile_cost: Callable[[int, int, float], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``profile_cost(tokens, prompts, share)``: the latency profile's time for a batch on this
        worker (``profile_prefill``), for ``easerve_prefill_profile_seconds``; None: not counted."""
        self.engine = engine
        self.metrics = metrics
        self.decode = decode
        self.stage = stage
        self.batcher: PrefillBatcher[Pending] = PrefillBatcher(max_batch_tokens)
        self.sm_share = sm_share or (lambda: 1.0)
        self.partition = partition
        self.profile_cost = profile_cost
        self.clock = clock
        self._received_at: dict[str, float] = {}
        self._arrival = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._handoffs: dict[str, asyncio.Task[None]] = {}
        """The decode handoff of each request being decoded (``cancel`` stops it)."""
        self._cancelled: set[str] = set()
        """Cancelled before their prefill ran: dropped when their batch is taken."""
        self._queued: set[str] = set()
        """Requests received and not yet handed to decode (or ended)."""
        self._inflight = 0
        self._rows: dict[str, Any] = {}
        """Embedding rows per queued request (a real engine merges them; the sim engine ignores them)."""
        self.stop_token_ids: tuple[int, ...] = tuple(getattr(engine, "stop_token_ids", ()))
        self.kv_chunk_bytes = KV_CHUNK_BYTES
        self.blobs = HostBlobs.from_env()
        """Same-host shared memory for the KV bytes and envelopes (``workers.blobs``)."""
        self._ipc_refused: set[int] = set()
        """Decode instances that refused a same-GPU KV share (another GPU): sent host copies."""
        self._ipc_off = False
        """Exporting a share failed here: every handoff takes the host path."""
        self._ipc_outstanding = 0
        self.ipc_max_outstanding = int(os.environ.get(IPC_OUTSTANDING_ENV, IPC_MAX_OUTSTANDING))
        """Caches offered by IPC and not yet copied by decode: each holds its device memory here
        until then (a decode that falls behind would otherwise grow this GPU's memory without bound)."""

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet handed on (the local prefill's drain waits for 0)."""
        return self._inflight

    async def generate(self, envelope: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if isinstance(envelope, dict) and "cancel" in envelope:  # the encode worker's client went away
            for rid in envelope.get("cancel") or ():
                self.cancel(str(rid))
            yield {"ack": True}
            return
        try:
            metas = list(envelope["requests"])
            raw: Any
            if "buffer_raw" in envelope:  # from the encode worker of this process (``InProcessPool``)
                raw = envelope.pop("buffer_raw")
            elif "buffer_blob" in envelope:
                if self.blobs is None:
                    raise ValueError("a same-host blob was sent, but this worker has no blob directory")
                raw = await self.blobs.take(str(envelope["buffer_blob"]))
            else:
                raw = b64d(envelope["buffer"])
            arrays = Envelope.unpack(raw, envelope["index"])
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
            if meta["id"] in arrays:
                self._rows[meta["id"]] = arrays[meta["id"]]
            self.batcher.add((meta, q), int(meta["text_tokens"]) + int(meta["mm_tokens"]))
            self._queued.add(str(meta["id"]))
            self._received_at[str(meta["id"])] = self.clock()
        self._inflight += len(metas)
        self._gauges()
        self._arrival.set()
        remaining = len(metas)
        while remaining:
            item = await q.get()
            if item.get("done") or "error" in item:
                remaining -= 1
                self._inflight -= 1
                self._queued.discard(str(item.get("id")))
                outcome = "cancelled" if item.get("cancelled") else "error" if "error" in item else "ok"
                self.metrics.stage_requests.labels(self.stage, outcome).inc()
                self._gauges()
            yield item

    def cancel(self, rid: str) -> None:
        """Nobody waits for ``rid`` any more: a request still queued is dropped when its batch is
        taken (no prefill for it), one being decoded has its decode stream stopped (the decode
        worker then frees its slot and KV at the next step)."""
        task = self._handoffs.get(rid)
        if task is not None:
            task.cancel()
        elif rid in self._queued:
            self._cancelled.add(rid)

    def _count_batch(self, inputs: list[PrefillInput], share: float, engine_s: float, waited_s: float) -> None:
        m, st = self.metrics, self.stage
        m.prefill_batches.labels(st).inc()
        m.prefill_batch_requests.labels(st).inc(len(inputs))
        m.prefill_engine_seconds.labels(st).inc(engine_s)
        m.prefill_queue_wait_seconds.labels(st).inc(max(0.0, waited_s))
        if self.profile_cost is not None:
            tokens = sum(i.text_tokens + i.mm_tokens for i in inputs)
            m.prefill_profile_seconds.labels(st).inc(self.profile_cost(tokens, len(inputs), share))

    def _gauges(self) -> None:
        self.metrics.queue_depth.labels(self.stage).set(self.batcher.pending)
        self.metrics.inflight.labels(self.stage).set(self._inflight)

    async def run(self) -> None:
        while True:
            if not self.batcher:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            batch, _tokens = self.batcher.take()
            taken = self.clock()
            waits = {str(m["id"]): taken - self._received_at.pop(str(m["id"]), taken) for m, _ in batch}
            if self._cancelled:
                batch = self._drop_cancelled(batch)
                if not batch:
                    continue
            waited = sum(waits[str(m["id"])] for m, _ in batch)
            self._gauges()
            inputs = [
                PrefillInput(
                    m["id"], int(m["text_tokens"]), int(m["mm_tokens"]), int(m["seed"]),
                    embedding=self._rows.pop(m["id"], None), extra=m, sampling=Sampling.from_wire(m),
                )
                for m, _ in batch
            ]
            share = await self.partition.granted(len(inputs)) if self.partition is not None else self.sm_share()
            t0 = self.clock()
            try:
                outs = await self.engine.prefill(inputs, share)
            except Exception as exc:
                log.exception("prefill batch failed")
                if self.partition is not None:
                    self.partition.idle()
                for m, q in batch:
                    q.put_nowait({"id": m["id"], "error": f"{self.stage} failed: {exc}"})
                continue
            self._count_batch(inputs, share, self.clock() - t0, waited)
            if self.partition is not None and not self.batcher:
                self.partition.idle()
            for (meta, q), out in zip(batch, outs, strict=True):
                q.put_nowait({"id": meta["id"], "token": out.first_token})
                if out.first_token in self.stop_token_ids and not meta.get("ignore_eos"):
                    q.put_nowait({"id": meta["id"], "done": True, "finish_reason": "stop"})
                    continue
                if int(meta["max_tokens"]) <= 1:
                    q.put_nowait({"id": meta["id"], "done": True})
                    continue
                rid = str(meta["id"])
                if rid in self._cancelled:  # cancelled while its prefill ran
                    self._cancelled.discard(rid)
                    q.put_nowait({"id": rid, "error": "cancelled: the client went away", "cancelled": True})
                    continue
                self._queued.discard(rid)
                task = asyncio.create_task(self._handoff(meta, out, q))
                self._tasks.add(task)
                self._handoffs[rid] = task
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(functools.partial(self._handoff_done, rid))

    def _handoff_done(self, rid: str, _task: asyncio.Task[None]) -> None:
        self._handoffs.pop(rid, None)

    def _drop_cancelled(self, batch: list[Pending]) -> list[Pending]:
        keep = []
        for meta, q in batch:
            rid = str(meta["id"])
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                self._rows.pop(rid, None)
                q.put_nowait({"id": rid, "error": "cancelled: the client went away", "cancelled": True})
            else:
                keep.append((meta, q))
        return keep

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
            **Sampling.from_wire(meta).wire(),
            **({"ignore_eos": True} if meta.get("ignore_eos") else {}),
        }
        expected = int(meta["max_tokens"]) - 1
        got = 0
        finish = None
        blob: str | None = None
        answered: Callable[[bool, bool], None] | None = None  # the IPC share's: decode took it, or refused it
        try:
            instance = None
            if out.has_kv():  # a real engine: move the KV cache to one decode instance first
                instance = self.decode.pick()
                req["kv_meta"] = dict(out.kv_meta)
                t0 = time.monotonic()
                answered = await self._share_kv(out, instance, req)
                if answered is None:
                    blob = await self._host_kv(rid, out, instance, req)
                self.metrics.kv_handoff_bytes.inc(out.kv_bytes)
                self.metrics.kv_handoff_seconds.observe(time.monotonic() - t0)
            for _attempt in range(2):  # a second time only if decode refused the IPC share
                refused = False
                async for item in self.decode.stream(req, instance=instance):
                    if answered is not None:  # decode's first answer: it copied the cache, or refused it
                        refused = bool(item.get("kv_ipc_refused"))
                        answered(not refused, bool(item.get("kv_ipc_mapped")))
                        answered = None
                        self._ipc_outstanding -= 1
                    if refused or item.get("kv_taken"):
                        continue  # a refusal is decode's only item: the host copy follows
                    if "error" in item:
                        raise StageError(str(item["error"]))
                    if "finish_reason" in item:
                        finish = item["finish_reason"]
                        continue
                    got += 1
                    q.put_nowait({"id": rid, "token": item["token"]})
                if not refused:
                    break
                assert instance is not None
                log.warning("decode instance %s refused a same-GPU KV share; sending it host copies", instance)
                self._ipc_refused.add(instance)
                req.pop("kv_ipc", None)
                blob = await self._host_kv(rid, out, instance, req)
            if got != expected and finish != "stop":
                raise StageError(f"decode stream ended after {got} of {expected} tokens")
            q.put_nowait({"id": rid, "done": True, "finish_reason": finish or "length"})
        except StageError as exc:
            q.put_nowait({"id": rid, "error": str(exc)})
        except asyncio.CancelledError:  # cancel(): the envelope's stream still counts it as ended
            q.put_nowait({"id": rid, "error": "cancelled: the client went away", "cancelled": True})
            raise
        except Exception as exc:  # never leave a request hanging
            log.exception("handoff failed")
            q.put_nowait({"id": rid, "error": f"decode handoff failed: {exc}"})
        finally:
            if blob is not None and self.blobs is not None:
                self.blobs.discard(blob)  # taken by decode, unless it never got that far
            if answered is not None:  # no answer came (decode died or the client left): its tensor goes
                self._ipc_outstanding -= 1  # with ``out``; the IPC count it may still hold is not known

    async def _share_kv(self, out: PrefillOutput, instance: int, req: dict[str, Any]) -> Callable[[bool, bool], None] | None:
        """Offer decode ``instance`` the cache by CUDA IPC (``engines.kv_ipc``) where the engine can;
        returns what to call with decode's answer, or None (the host path is to be taken)."""
        if (out.share_kv is None or self._ipc_off or instance in self._ipc_refused
                or self._ipc_outstanding >= self.ipc_max_outstanding):
            return None  # beyond the bound, the cache leaves the device as before: its memory is the host's
        try:
            req["kv_ipc"], answered = await asyncio.to_thread(out.share_kv)
        except Exception as exc:  # noqa: BLE001 - this driver or allocator cannot export: host copies from now on
            log.warning("a same-GPU KV share failed (%r); the KV handoff takes host copies from now on", exc)
            self._ipc_off = True
            return None
        self._ipc_outstanding += 1
        return answered

    async def _host_kv(self, rid: str, out: PrefillOutput, instance: int, req: dict[str, Any]) -> str | None:
        """Put the cache's bytes where decode ``instance`` reads them (a same-host blob, else chunks
        sent ahead); returns the blob's name (discarded once the request ends), if one was made."""
        kv = out.kv
        if kv is None and out.pack_kv is not None:  # off the loop: a device-to-host copy
            kv = await asyncio.to_thread(out.pack_kv)
        assert kv is not None
        if self.blobs is not None:
            req["kv_blob"] = blob = await self.blobs.put(kv)
            return blob
        req["kv_chunks"] = await self._send_kv(rid, kv, instance)
        return None

    async def _send_kv(self, rid: str, kv: bytes | bytearray | memoryview, instance: int) -> int:
        """Send ``kv`` to decode ``instance`` in chunks, a few in flight; returns the chunk count."""
        size = max(1, self.kv_chunk_bytes)
        n = max(1, -(-len(kv) // size))
        view = memoryview(kv)

        async def one(i: int) -> None:
            msg = {"kv_chunk": {"id": rid, "seq": i, "of": n, "b64": b64e(bytes(view[i * size : (i + 1) * size]))}}
            acked = False
            async for item in self.decode.stream(msg, instance=instance):
                if "error" in item:
                    raise StageError(str(item["error"]))
                acked = acked or bool(item.get("ack"))
            if not acked:
                raise StageError(f"decode did not acknowledge KV chunk {i} of {rid}")

        for start in range(0, n, KV_CHUNKS_IN_FLIGHT):
            await asyncio.gather(*(one(i) for i in range(start, min(n, start + KV_CHUNKS_IN_FLIGHT))))
        return n


def profile_prefill(spec: Any, tp: int) -> Callable[[int, int, float], float] | None:
    """``prefill_s(tokens, share, tp, prompts)`` of the spec's latency profile for a worker of TP
    ``tp``, or None when none loads (then the profile counter is not kept)."""
    try:
        from easerve_runtime.profiles import spec_profile

        prof = spec_profile(spec)
    except (ValueError, OSError, KeyError) as exc:
        log.info("no latency profile for the prefill counters: %s", exc)
        return None

    def cost(tokens: int, prompts: int, share: float) -> float:
        try:
            return float(prof.prefill_s(tokens, share, tp, max(1, prompts)))
        except ValueError:
            return 0.0

    return cost
