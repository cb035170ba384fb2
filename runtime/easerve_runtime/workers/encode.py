"""The encode worker: micro-batch arrivals, encode, route each request, ship envelopes.

This is the thin asyncio shell around pure policies that the twin (``sim/stages.py``) drives too:
``policies.batcher`` (when a micro-batch leaves), ``policies.post_encode`` (route, pick, group)
and ``policies.envelope`` (pack, send window); it owns only the clock and the I/O:

1. ``generate`` (one call per request, from the frontend) queues the request in the batcher and
   streams back whatever the batch loop delivers for it.
2. ``run`` polls the batcher whenever the encoder is free and otherwise sleeps until an arrival
   or the batcher's ``next_wakeup``; while a batch encodes, arrivals simply accumulate.
3. After encoding, ``PostEncodeRouter`` sends each request remote (the live prefill instance to
   which this worker has the fewest requests not yet prefilled) or local (the prefill worker
   sharing this GPU) and groups them per destination into ONE envelope each; a send window
   (``spec.encode.sendWindow``) caps envelopes in flight, so a slow prefill pool pushes back on
   the encoder instead of piling up memory. The first token of a request on an envelope's stream
   tells the router that its prefill is done (the router's load accounting).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.engines.base import Embedding, EncodeEngine, EncodeInput, MediaPart
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.batcher import Dispatch, make_batcher
from easerve_runtime.policies.envelope import SendWindow, build_envelopes
from easerve_runtime.policies.knobs import Applied, KnobChange, apply_knobs
from easerve_runtime.policies.post_encode import LOCAL, PostEncodeRouter
from easerve_runtime.workers.blobs import HostBlobs
from easerve_runtime.workers.dynamo_rt import on_context_stop
from easerve_runtime.workers.partition_link import PartitionLink
from easerve_runtime.workers.pool import StageError, StagePool
from easerve_runtime.workers.streams import Streams
from easerve_runtime.workers.wire import b64e, part_from_wire, request_meta

log = logging.getLogger("easerve.encode")


def embedding_array(emb: Embedding) -> np.ndarray[Any, Any]:
    """The embedding as an array for the envelope: its logical shape when the bytes match it."""
    n = 1
    for x in emb.shape:
        n *= x
    if len(emb.data) == n * 2 and emb.shape:
        return np.frombuffer(emb.data, dtype=np.uint16).reshape(emb.shape)  # bf16 carried as raw 2 bytes
    if emb.dtype in ("float32", "float16") and emb.shape and len(emb.data) == n * np.dtype(emb.dtype).itemsize:
        return np.frombuffer(emb.data, dtype=np.dtype(emb.dtype)).reshape(emb.shape)  # a CPU engine's rows
    return np.frombuffer(emb.data, dtype=np.uint8)


class EncodeWorker:
    stage = "encode"

    def __init__(
        self,
        spec: EPDDeploymentSpec,
        engine: EncodeEngine,
        metrics: Metrics,
        remote: StagePool | None,
        local: StagePool | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        send_window: int | None = None,
        sm_share: Callable[[int], float] | None = None,
        partition: PartitionLink | None = None,
    ) -> None:
        s = spec.offload.ratio
        if s > 0 and remote is None:
            raise ValueError(f"spec.offload.ratio is {s} but this encode worker has no remote prefill pool")
        if s < 1 and local is None:
            raise ValueError(f"spec.offload.ratio is {s} but this encode worker has no local prefill worker")
        self.spec = spec
        self.engine = engine
        self.metrics = metrics
        self.remote = remote
        self.local = local
        self.clock = clock
        self.batcher = make_batcher(spec.encode)
        self.router: PostEncodeRouter[Any] = PostEncodeRouter(s, has_local=local is not None)
        self.window = SendWindow(send_window if send_window is not None else spec.encode.send_window)
        self.sm_share = sm_share or (lambda batch: 1.0)
        self.partition = partition
        self.streams = Streams()
        self._arrival = asyncio.Event()
        self._window_free = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.blobs = HostBlobs.from_env()
        """Same-host shared memory for the envelopes' bytes (``workers.blobs``); None: base64 inline."""
        metrics.encode_batch_bound.set(spec.encode.batch_bound)
        metrics.offload_ratio.set(s)
        self._profile_encode_s = _profile_encode(spec)
        """The profile's time of a micro-batch (items, SM share), for ``easerve_encode_profile_seconds_total``."""

    # -- live knobs (docs/adapt.md) ------------------------------------------------------------
    def apply_knobs(self, change: KnobChange) -> Applied:
        """Take new B / dispatch parameters / s between two requests (no restart, nothing dropped).

        Runs on the event loop, so no batch is being polled concurrently; pending requests stay
        queued and the loop is woken because the dispatch deadline may have moved.
        """
        res = apply_knobs(
            self.batcher,
            self.router.deficit,
            change,
            has_local=self.local is not None,
            has_remote=self.remote is not None,
        )
        self.batcher = res.batcher
        update: dict[str, Any] = {}
        if change.encode is not None:
            update["encode"] = change.encode
            self.metrics.encode_batch_bound.set(change.encode.batch_bound)
        if change.ratio is not None and not res.refused:
            update["offload"] = self.spec.offload.model_copy(update={"ratio": change.ratio})
            self.metrics.offload_ratio.set(change.ratio)
        if update:
            self.spec = self.spec.model_copy(update=update)
        for what in res.applied:
            log.info("live knob applied: %s", what)
            self.metrics.knob_updates.labels("applied").inc()
        for why in res.refused:
            log.warning("live knob refused: %s", why)
            self.metrics.knob_updates.labels("refused").inc()
        self._arrival.set()
        return res

    # -- per-request handler (Dynamo endpoint) ----------------------------------------------
    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        rid = str(request["id"])
        try:
            self.streams.open(rid)
            parts = [part_from_wire(p) for p in request.get("parts", [])]
        except (KeyError, ValueError, TypeError) as exc:
            yield {"error": f"encode: bad request {rid}: {exc}"}
            return
        now = self.clock()
        self.batcher.on_arrival((request, parts, now), now)
        self.metrics.queue_depth.labels(self.stage).set(self.batcher.pending)
        self.metrics.inflight.labels(self.stage).set(len(self.streams))
        self._arrival.set()
        # a caller that stops the request (the frontend, when its client went away) ends the
        # stream here; the next token for it then finds nobody and cancels it downstream (_send)
        watch = on_context_stop(context, lambda: self.streams.close(rid))
        try:
            async for item in self.streams.drain(rid):
                yield item
        finally:
            if watch is not None:
                watch.cancel()
        self.metrics.inflight.labels(self.stage).set(len(self.streams))

    # -- batch loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            now = self.clock()
            d = self.batcher.poll(now)
            if d is None:
                wake = self.batcher.next_wakeup(now)
                self._arrival.clear()
                timeout = None if wake is None else max(0.0, wake - now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrival.wait(), timeout)
                continue
            try:
                await self._run_batch(d)
            except Exception as exc:  # keep serving; fail only this batch's requests
                log.exception("encode batch failed")
                for req, _parts, _t in d.items:
                    self._fail(str(req["id"]), f"encode failed: {exc}")

    def _fail(self, rid: str, message: str) -> None:
        self.streams.put(rid, {"error": message})
        self.streams.close(rid)

    async def _run_batch(self, d: Dispatch[Any]) -> None:
        m = self.metrics
        gone = [it for it in d.items if str(it[0]["id"]) not in self.streams]
        if gone:  # their clients went away while they waited in the batcher: no encoder time for them
            m.stage_requests.labels(self.stage, "cancelled").inc(len(gone))
            d = dataclasses.replace(d, items=tuple(it for it in d.items if str(it[0]["id"]) in self.streams))
            if not d.items:
                return
        m.encode_dispatch.labels(str(d.reason)).inc()
        m.encode_batch_size.observe(len(d.items))
        m.encode_rate.set(self.batcher.rate_estimate if self.batcher.rate_estimate != float("inf") else 0.0)
        m.queue_depth.labels(self.stage).set(self.batcher.pending)
        for _req, _parts, t in d.items:
            m.encode_queue_wait.observe(max(0.0, d.at - t))
        inputs = [
            EncodeInput(
                str(req["id"]), tuple[MediaPart, ...](parts), int(req.get("seed", 0)), tuple(req.get("messages") or ())
            )
            for req, parts, _t in d.items
        ]
        items_of = getattr(self.engine, "batch_items", None)
        items = int(items_of(inputs)) if items_of is not None else len(inputs)
        share = self.partition.share(items) if self.partition is not None else self.sm_share(items)
        m.encode_sm_share.set(share)
        m.encode_items.inc(items)
        if self._profile_encode_s is not None and items:
            m.encode_profile_seconds.inc(self._profile_encode_s(items, share))
        t0 = self.clock()
        try:
            embs = await self.engine.encode(inputs, share)
        finally:
            if self.partition is not None:
                self.partition.idle()
        m.encode_seconds.observe(self.clock() - t0)
        by_id = {str(req["id"]): (req, emb) for (req, _parts, _t), emb in zip(d.items, embs, strict=True)}
        remotes = self.remote.instances() if self.remote is not None else []
        plan = self.router.route(list(by_id), remotes)
        for rid in plan.unroutable:
            m.routed.labels("remote").inc()
            self._fail(rid, "no live prefill instance")
        entries: list[tuple[str, Any, Any]] = []
        metas: dict[Any, list[dict[str, Any]]] = {}
        for dest, rids in plan.groups.items():
            route = LOCAL if dest == LOCAL else "remote"
            for rid in rids:
                req, emb = by_id[rid]
                m.routed.labels(route).inc()
                entries.append((rid, dest, embedding_array(emb)))
                # a real engine's extra (prompt token ids, the tokenizer's text-token count) overrides the estimate
                meta = request_meta(req, emb.tokens) | {"route": route} | dict(emb.extra)
                metas.setdefault(dest, []).append(meta)
        m.deficit.set(self.router.deficit.deficit)
        for dest, env in build_envelopes(entries).items():
            while not self.window.try_acquire():
                self._window_free.clear()
                await self._window_free.wait()
            m.envelope_in_flight.set(self.window.in_flight)
            m.envelope_sends.inc()
            m.envelope_bytes.inc(env.nbytes)
            buffer, index = env.pack()
            msg: dict[str, Any] = {"index": index, "requests": metas[dest]}
            task = asyncio.create_task(self._send(dest, msg, buffer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel_downstream(self, pool: StagePool, dest: Any, rid: str) -> None:
        """Tell the prefill worker holding ``rid`` that nobody waits for it any more: it drops the
        request if it has not run yet, or stops its decode stream (the envelope carries other
        requests, so its stream cannot simply be closed)."""
        try:
            async for _ in pool.stream({"cancel": [rid]}, instance=None if dest == LOCAL else dest):
                pass
        except StageError as exc:  # best effort: the request still ends when its tokens do
            log.info("cancel of %s not delivered: %s", rid, exc)

    def _release(self) -> None:
        self.window.release()
        self.metrics.envelope_in_flight.set(self.window.in_flight)
        self._window_free.set()

    async def _send(self, dest: Any, msg: dict[str, Any], buffer: bytes | bytearray | memoryview) -> None:
        """One envelope to ``dest``; its bytes go as a same-host blob (written here, in the send's own
        task, so the next micro-batch is not held up) or inline as base64."""
        reqs = {r["id"]: r for r in msg["requests"]}
        cancelled: set[str] = set()
        pending = set(reqs)
        unprefilled = set(reqs)  # the router counts these as outstanding at ``dest``
        released = False
        pool = self.local if dest == LOCAL else self.remote
        assert pool is not None
        try:
            if getattr(pool, "in_process", False):  # the local prefill in this process: the buffer itself
                msg["buffer_raw"] = buffer
            elif self.blobs is not None:
                msg["buffer_blob"] = await self.blobs.put(buffer)
            else:
                msg["buffer"] = b64e(buffer)
            del buffer
            async for item in pool.stream(msg, instance=None if dest == LOCAL else dest, weight=len(reqs)):
                if item.get("ack"):
                    if not released:
                        released = True
                        self._release()
                    continue
                rid = item.get("id")
                if rid not in pending:
                    continue
                if rid in unprefilled:  # first token, or an error before it: prefill is over
                    unprefilled.discard(rid)
                    self.router.prefilled(dest)
                if "token" in item:
                    if not self.streams.put(rid, {"token": item["token"]}) and rid not in cancelled:
                        cancelled.add(rid)  # its client went away: stop its prefill and decode
                        self._spawn(self._cancel_downstream(pool, dest, rid))
                elif item.get("done"):
                    r = reqs[rid]
                    self.streams.put(
                        rid,
                        {
                            "done": True,
                            "route": r["route"],
                            "prompt_tokens": r["text_tokens"] + r["mm_tokens"],
                            "finish_reason": item.get("finish_reason"),
                        },
                    )
                    self.streams.close(rid)
                    pending.discard(rid)
                elif "error" in item:
                    self._fail(rid, str(item["error"]))
                    pending.discard(rid)
        except StageError as exc:
            for rid in pending:
                self._fail(rid, str(exc))
            pending.clear()
        finally:
            if self.blobs is not None and "buffer_blob" in msg:
                self.blobs.discard(msg["buffer_blob"])  # taken by the receiver, unless it never read it
            if not released:
                self._release()
            if unprefilled:
                self.router.prefilled(dest, len(unprefilled))
            for rid in pending:
                self._fail(rid, "prefill stream ended before the request finished")


def _profile_encode(spec: EPDDeploymentSpec) -> Callable[[int, float], float] | None:
    """``encode_s(items, share)`` of the spec's latency profile (``spec.engine.profile``: what the
    twin, and the autopilot's re-tunes, time this encoder with), or None when none loads: then the
    autopilot's calibration falls back to the mean batch (docs/adapt.md)."""
    try:
        from easerve_runtime.profiles import spec_profile

        fn = spec_profile(spec).encode_s
    except (ValueError, OSError, KeyError) as exc:
        log.info("no latency profile for the calibration metric: %s", exc)
        return None

    def cost(items: int, share: float) -> float:
        try:
            return float(fn(items, share))
        except ValueError:
            return 0.0

    return cost
