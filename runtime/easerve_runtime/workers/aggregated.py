"""The aggregated worker (``spec.mode: aggregated``): encode, prefill and decode in ONE engine loop.

The vLLM-style baseline on the same engines as the disaggregated pipeline: one process per GPU
hosts the stage engines (torch: ``HFEncodeEngine``, ``HFPrefillEngine`` and ``HFDecodeEngine``
sharing the language model's weights; sim: one ``SimEngine``) and runs one loop whose iterations
the shared pure policy plans (``policies.aggregated.AggregatedPlanner``, the twin's aggregated
baseline runs the same object). Each iteration:

1. the planner admits waiting requests FIFO under ``spec.decode.maxSequences`` and the KV memory
   (torch: the decode engine's slots; sim: the profile's KV budget at
   ``spec.decode.kvMemoryFraction``) and cuts prefill chunks within ``spec.aggregated.tokenBudget``
   less one token per running sequence;
2. the newly admitted requests' media are encoded (one encoder call for all of them);
3. the planned chunks are prefilled (one engine call); each request whose prompt completes streams
   its first token at once;
4. one decode step runs over the sequences that were running when the iteration was planned;
5. the newly prefilled sequences join the decode batch: their KV cache goes into a decode slot in
   this process (no network handoff; a torch cache stays on the device).

An engine with ``prefill_chunks`` (the sim engine) prefills chunks, split across iterations as
vLLM's chunked prefill does; one without (the torch engine) prefills whole prompts, each
iteration's prompts within the token budget, a longer prompt alone (docs/engine.md).

The worker serves the encode component's endpoint and streams what an encode worker streams
(``{"token"}`` items, then ``{"done", "route": "aggregated", "prompt_tokens", "finish_reason"}``),
so the frontend talks to it unchanged.

``$EASERVE_DECODE_STATS`` (a directory): like a decode worker, the worker writes
``decode-<pid>.json`` there (the loop's time per phase and the decode engine's counters).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.engines.base import (
    DecodeSequence,
    EncodeInput,
    MediaPart,
    PrefillInput,
    PrefillOutput,
    Sampling,
    SlotDecodeEngine,
)
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.aggregated import AggregatedPlanner, Iteration
from easerve_runtime.workers.dynamo_rt import on_context_stop
from easerve_runtime.workers.encode import embedding_array
from easerve_runtime.workers.stats_file import StatsFile
from easerve_runtime.workers.wire import media_tokens_for, part_from_wire, request_meta

log = logging.getLogger("easerve.aggregated")

ROUTE = "aggregated"


class _Req:
    """One request in the worker: its wire request, its stream and where it is."""

    __slots__ = ("rid", "wire", "parts", "q", "need", "tokens", "input", "seq", "cancelled", "ended")

    def __init__(self, rid: str, wire: dict[str, Any], parts: list[MediaPart], need: float, tokens: int) -> None:
        self.rid = rid
        self.wire = wire
        self.parts = parts
        self.q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.need = need
        self.tokens = tokens
        self.input: PrefillInput | None = None
        self.seq: DecodeSequence | None = None
        self.cancelled = False
        self.ended = False


class AggregatedWorker:
    stage = "aggregated"

    def __init__(
        self,
        encoder: Any,
        prefiller: Any,
        decoder: Any,
        metrics: Metrics,
        *,
        token_budget: int,
        max_sequences: int,
        kv_capacity_bytes: float,
        kv_bytes: Callable[[int], float],
        mm_tokens: Callable[[Sequence[MediaPart]], int],
    ) -> None:
        self.encoder = encoder
        self.prefiller = prefiller
        self.decoder = decoder
        self.metrics = metrics
        self.slots: SlotDecodeEngine | None = decoder if isinstance(decoder, SlotDecodeEngine) else None
        self.chunked = callable(getattr(prefiller, "prefill_chunks", None))
        self.planner: AggregatedPlanner[_Req] = AggregatedPlanner(
            token_budget, max_sequences, kv_capacity_bytes, chunked=self.chunked
        )
        self.kv_bytes = kv_bytes
        self.mm_tokens = mm_tokens
        self.stop_token_ids: tuple[int, ...] = tuple(getattr(decoder, "stop_token_ids", ()))
        self._running: list[_Req] = []
        self._arrival = asyncio.Event()
        self.iterations = 0
        self.max_batch = 0
        self.loop_stats: dict[str, float] = {"iterations": 0, "step_s": 0.0, "admit_s": 0.0, "idle_s": 0.0,
                                             "loop_s": 0.0, "admitted": 0, "encode_s": 0.0, "prefill_s": 0.0,
                                             "decode_s": 0.0}
        """Cumulative: ``step_s`` whole iterations, ``admit_s`` joining decode slots, per phase the rest."""
        self._stats = StatsFile("aggregated")

    @classmethod
    def for_spec(cls, spec: EPDDeploymentSpec, engines: tuple[Any, Any, Any], metrics: Metrics) -> AggregatedWorker:
        """The worker of an aggregated deployment over ``(encoder, prefiller, decoder)`` engines:
        ``spec.aggregated.tokenBudget``, ``spec.decode.maxSequences``, and KV memory counted in the
        decode engine's slots (torch) or in the profile's bytes at ``spec.decode.kvMemoryFraction``
        over the worker's TP (sim), as the twin counts it."""
        enc, pre, dec = engines
        agg, d = spec.aggregated_engine, spec.decode
        if isinstance(dec, SlotDecodeEngine):
            capacity = float(getattr(dec, "slots", math.inf))
            kv_bytes: Callable[[int], float] = lambda _t: 1.0  # noqa: E731 - one slot per sequence
        else:
            profile = getattr(dec, "profile", None)
            if profile is None:
                from easerve_runtime.profiles import spec_profile

                profile = spec_profile(spec)
            capacity = float(profile.kv_budget_bytes(agg.tensor_parallel, d.kv_memory_fraction))
            kv_bytes = profile.kv_bytes
        mm = getattr(enc, "mm_tokens", None)
        if not callable(mm):
            part_tokens = media_tokens_for(spec)

            def mm(parts: Sequence[MediaPart]) -> int:
                return sum(part_tokens(p) for p in parts)
        return cls(
            enc, pre, dec, metrics, token_budget=agg.token_budget, max_sequences=d.max_sequences,
            kv_capacity_bytes=capacity, kv_bytes=kv_bytes, mm_tokens=mm,
        )  # fmt: skip

    # -- per-request handler (the encode component's endpoint) ---------------------------------
    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            rid = str(request["id"])
            parts = [part_from_wire(p) for p in request.get("parts", [])]
            tokens = int(request["text_tokens"]) + int(self.mm_tokens(parts))
            need = float(self.kv_bytes(tokens + int(request["max_tokens"])))
        except (KeyError, ValueError, TypeError) as exc:
            yield {"error": f"aggregated: bad request: {exc}"}
            return
        r = _Req(rid, request, parts, need, tokens)
        self.planner.add(r, tokens, need)
        self._gauges()
        self._arrival.set()
        watch = on_context_stop(context, lambda: self._cancel(r))
        try:
            while True:
                item = await r.q.get()
                yield item
                if item.get("done") or "error" in item:
                    break
        finally:
            if watch is not None:
                watch.cancel()
            if not r.ended:  # the caller went away (the stream was closed)
                self._cancel(r)

    def _cancel(self, r: _Req) -> None:
        if r.ended or r.cancelled:
            return
        r.cancelled = True
        self.metrics.stage_requests.labels(self.stage, "cancelled").inc()
        self._arrival.set()

    def _end(self, r: _Req, item: dict[str, Any]) -> None:
        if not r.ended:
            r.ended = True
            r.q.put_nowait(item)
            if "error" not in item:
                self.metrics.stage_requests.labels(self.stage, "ok").inc()

    def _fail(self, r: _Req, message: str) -> None:
        self._end(r, {"error": message})
        self.metrics.stage_requests.labels(self.stage, "error").inc()

    def _done(self, r: _Req) -> None:
        assert r.seq is not None and r.input is not None
        self._end(r, {
            "done": True,
            "route": ROUTE,
            "prompt_tokens": r.input.prompt_tokens,
            "finish_reason": "stop" if r.seq.stopped else "length",
        })  # fmt: skip

    def _gauges(self) -> None:
        self.metrics.queue_depth.labels(self.stage).set(self.planner.waiting)
        self.metrics.inflight.labels(self.stage).set(len(self.planner) + len(self._running))

    # -- the engine loop -----------------------------------------------------------------------
    async def run(self) -> None:
        ls = self.loop_stats
        clock = time.perf_counter
        t_loop = clock()
        while True:
            t0 = clock()
            ls["loop_s"] += t0 - t_loop
            t_loop = t0
            self._reap()
            it = self.planner.plan()
            if it.empty:
                self._gauges()
                self._write_stats(t0, force=True)
                self._arrival.clear()
                await self._arrival.wait()
                ls["idle_s"] += clock() - t0
                continue
            self._gauges()
            await self._iteration(it)
            t1 = clock()
            ls["step_s"] += t1 - t0
            self._write_stats(t1)

    def _write_stats(self, now: float, force: bool = False) -> None:
        self._stats.write(now, lambda: {"running": len(self._running), "waiting": self.planner.waiting,
                                        "loop": dict(self.loop_stats), "engine": getattr(self.decoder, "stats", None)},
                          force)

    def _reap(self) -> None:
        """Requests whose caller went away: out of the queue, or out of the decode batch."""
        if self._running and any(r.cancelled for r in self._running):
            keep = []
            for r in self._running:
                if r.cancelled:
                    self._leave(r)
                    r.ended = True
                else:
                    keep.append(r)
            self._running = keep
        # waiting ones leave the planner here; one with a chunk planned leaves when it comes up
        for r in [r for r in self.planner.queued() if r.cancelled]:
            self.planner.drop(r)
            r.ended = True

    def _leave(self, r: _Req) -> None:
        """A running sequence leaves the batch: its slot and its reservation are freed."""
        self.planner.finish(r.need)
        if self.slots is not None:
            self.slots.release(r.rid)

    def _abandon(self, reqs: list[_Req], message: str) -> None:
        """Requests of a failed phase: their reservation is freed, their clients told."""
        for r in reqs:
            if not self.planner.drop(r):  # its last chunk was planned: it is no longer queued
                self.planner.prefilled(r.need, False)
            self._fail(r, message)

    async def _iteration(self, it: Iteration[_Req]) -> None:
        self.iterations += 1
        running = list(self._running)
        assert len(running) == it.decodes, (len(running), it.decodes)
        ls, clock = self.loop_stats, time.perf_counter
        ls["iterations"] += 1
        planned = [c.item for c in it.chunks]
        new = [c.item for c in it.chunks if c.first]
        t0 = clock()
        if new and not await self._encode(new):
            planned = [r for r in planned if r not in new]
            it = Iteration([c for c in it.chunks if c.item in planned], it.tokens, it.decodes)
        t1 = clock()
        joining = await self._prefill(it) if it.chunks else []
        t2 = clock()
        if running:
            await self._decode(running)
        t3 = clock()
        for r in joining:
            await self._join(r)
        ls["admitted"] += len(joining)
        ls["encode_s"] += t1 - t0
        ls["prefill_s"] += t2 - t1
        ls["decode_s"] += t3 - t2
        ls["admit_s"] += clock() - t3
        self._gauges()

    async def _encode(self, new: list[_Req]) -> bool:
        inputs = [
            EncodeInput(r.rid, tuple(r.parts), int(r.wire.get("seed", 0)), tuple(r.wire.get("messages") or ()))
            for r in new
        ]
        try:
            embs = await self.encoder.encode(inputs, 1.0)
        except Exception as exc:
            log.exception("encode failed")
            self._abandon(new, f"encode failed: {exc}")
            return False
        self.metrics.encode_items.inc(sum(len(r.parts) for r in new))
        for r, emb in zip(new, embs, strict=True):
            meta = request_meta(r.wire, emb.tokens) | {"route": ROUTE} | dict(emb.extra)
            r.input = PrefillInput(
                r.rid, int(meta["text_tokens"]), int(meta["mm_tokens"]), int(meta["seed"]),
                embedding=embedding_array(emb) if emb.tokens else None, extra=meta,
                sampling=Sampling.from_wire(meta),
            )  # fmt: skip
            if self.chunked and r.input.prompt_tokens != r.tokens:
                self.planner.resize(r, r.input.prompt_tokens)  # the processor's count
        return True

    async def _prefill(self, it: Iteration[_Req]) -> list[_Req]:
        """Prefill the planned chunks; stream each completed prompt's first token. Returns the
        requests that go on decoding."""
        reqs = [c.item for c in it.chunks]
        try:
            if self.chunked:
                outs: list[PrefillOutput | None] = await self.prefiller.prefill_chunks(
                    [(c.item.input, c.start, c.tokens) for c in it.chunks], 1.0
                )
            else:
                outs = list(await self.prefiller.prefill([r.input for r in reqs], 1.0))
        except Exception as exc:
            log.exception("prefill failed")
            self._abandon(reqs, f"prefill failed: {exc}")
            return []
        joining: list[_Req] = []
        for c, out in zip(it.chunks, outs, strict=True):
            r = c.item
            if not c.last:
                continue
            if out is None or r.input is None:  # the processor's prompt outgrew the planned chunks
                self.planner.prefilled(r.need, False)
                self._fail(r, "prefill: the prompt is longer than its planned chunks")
                continue
            stops = () if r.wire.get("ignore_eos") else self.stop_token_ids
            r.seq = DecodeSequence(
                request_id=r.rid, context_tokens=r.input.prompt_tokens, max_tokens=int(r.wire["max_tokens"]),
                seed=int(r.wire.get("seed", 0)), generated=[out.first_token], stop_token_ids=stops,
                sampling=r.input.sampling, kv=out.kv, kv_meta=dict(out.kv_meta), kv_local=out.kv_local,
            )  # fmt: skip
            if r.cancelled:
                self.planner.prefilled(r.need, False)
                r.ended = True
                continue
            r.q.put_nowait({"token": out.first_token})
            decodes = not r.seq.done
            self.planner.prefilled(r.need, decodes)
            if not decodes:
                self._done(r)
                continue
            if out.kv is None and out.kv_local is None and out.pack_kv is not None:
                r.seq.kv = await asyncio.to_thread(out.pack_kv)  # a device-to-host copy, off the loop
            joining.append(r)
        return joining

    async def _decode(self, running: list[_Req]) -> None:
        batch = [r.seq for r in running]
        assert all(s is not None for s in batch)
        self.metrics.decode_batch_size.observe(len(batch))
        self.max_batch = max(self.max_batch, len(batch))
        try:
            tokens = await self.decoder.decode_step(batch)
        except Exception as exc:
            log.exception("decode step failed")
            for r in running:
                self._leave(r)
                self._fail(r, f"decode failed: {exc}")
            self._running = [r for r in self._running if r not in running]
            return
        left: set[str] = set()
        for r, tok in zip(running, tokens, strict=True):
            seq = r.seq
            assert seq is not None
            seq.generated.append(tok)
            if not r.cancelled:
                r.q.put_nowait({"token": tok})
            if seq.done:
                self._leave(r)
                self._done(r)
                left.add(r.rid)
        if left:
            self._running = [r for r in self._running if r.rid not in left]

    async def _join(self, r: _Req) -> None:
        """A prefilled sequence takes a decode slot (its KV cache loaded in-process)."""
        assert r.seq is not None
        if r.cancelled:  # went away between its prefill and now
            self.planner.finish(r.need)
            r.ended = True
            return
        if self.slots is not None:
            try:
                await self.slots.admit(r.seq)
            except Exception as exc:
                self.planner.finish(r.need)
                self._fail(r, f"decode admission failed: {exc}")
                return
        self._running.append(r)
