"""The decode worker: continuous batching of sequences handed over by prefill, tokens streamed back.

Sequences join the running batch between any two steps (after their KV cache has been
received) and leave when they reach ``max_tokens``; each step is one engine call over the whole
running batch. Who joins is decided by the shared admission policy
(``policies.decode_admission.DecodeAdmission``, ``spec.decode``; the twin uses the same object):
at most ``maxSequences`` running, and a sequence joins only when its KV cache at full length
(prompt + ``max_tokens``) fits in the worker's KV capacity next to the running ones' reservations.
A sequence that does not fit waits (its client sees a later first decode token), never OOMs.

With a real engine that keeps KV caches in fixed slots (``SlotDecodeEngine``), the capacity is
the engine's slot count and each sequence needs one slot; the handed-over KV cache arrives in
chunks (``kv_chunk`` messages, see ``wire.py``) before the request that claims it. An engine that
can move caches to the device ahead of admission (``stage(seq)``, the torch engine) gets each
cache as it arrives, and the waiting ones as its staging buffers free up, so that joining the
batch costs a step almost nothing.

``$EASERVE_DECODE_STATS`` (a directory): the worker writes ``decode-<pid>.json`` there every few
seconds and whenever it goes idle: where the loop's time went (steps, admissions, idle) and the
engine's own counters (``stats``), cumulative (benchmarks take differences).
"""

from __future__ import annotations

import asyncio
import logging
import math
import mmap
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from easerve_runtime.api import DecodeSpec, EPDDeploymentSpec
from easerve_runtime.engines.base import DecodeEngine, DecodeSequence, Sampling, SlotDecodeEngine
from easerve_runtime.engines.kv_ipc import KVIPCRefused
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.decode_admission import DecodeAdmission
from easerve_runtime.workers.blobs import HostBlobs
from easerve_runtime.workers.dynamo_rt import on_context_stop
from easerve_runtime.workers.stats_file import StatsFile
from easerve_runtime.workers.wire import b64d

log = logging.getLogger("easerve.decode")

Entry = tuple[DecodeSequence, "asyncio.Queue[Any]", float]  # (sequence, its token queue, KV need)
_STOPPED = object()
"""Put in a request's queue when its Dynamo context is stopped or killed by the caller."""



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
        self.slots: SlotDecodeEngine | None = engine if isinstance(engine, SlotDecodeEngine) else None
        if admission is None and self.slots is not None:  # one fixed slot per sequence: count slots
            admission = DecodeAdmission(DecodeSpec().max_sequences, float(getattr(engine, "slots", math.inf)))
            kv_bytes = kv_bytes or (lambda _tokens: 1.0)
        self.admission: DecodeAdmission[Entry] = admission or DecodeAdmission(
            DecodeSpec().max_sequences, math.inf
        )
        self.kv_bytes = kv_bytes or (lambda tokens: 0.0)
        self._running: list[Entry] = []
        self._arrival = asyncio.Event()
        self._kv_in: dict[str, dict[int, bytes]] = {}
        self.blobs = HostBlobs.from_env()
        """Same-host shared memory the KV cache may arrive through (``workers.blobs``)."""
        self.stop_token_ids: tuple[int, ...] = tuple(getattr(engine, "stop_token_ids", ()))
        stage = getattr(engine, "stage", None)
        self._stage = stage if callable(stage) else None
        """The engine's ``stage(seq)``: start moving a cache to the device before admission (optional)."""
        self._unstaged: dict[str, DecodeSequence] = {}  # waiting, their cache still on the host (FIFO)
        self._cancelled: set[str] = set()
        """Requests whose caller went away, until the loop has dropped them (``_cancel``)."""
        self.loop_stats: dict[str, float] = {"iterations": 0, "step_s": 0.0, "admit_s": 0.0, "idle_s": 0.0,
                                             "loop_s": 0.0, "admitted": 0, "handoff_s": 0.0}
        self._entered: dict[str, float] = {}
        """When each waiting request reached ``generate`` (its KV handed over), until it is admitted:
        ``loop_stats.handoff_s`` sums the waits (KV taken and received, queued for a slot, the step
        boundary), the part of a request's time after its first token that no decode step counts."""
        self._stats = StatsFile("decode")

    @classmethod
    def for_spec(cls, spec: EPDDeploymentSpec, engine: DecodeEngine, metrics: Metrics) -> DecodeWorker:
        """The decode worker of a deployment: ``spec.decode``'s admission over this worker's KV
        capacity, from the engine when it reports one (``kv_capacity_bytes(memory_fraction)``),
        else from the latency profile (``kv_budget_bytes(tp, memory_fraction)``), the same figure
        the twin admits by."""
        d = spec.decode
        if isinstance(engine, SlotDecodeEngine):  # one fixed slot per sequence: count slots
            slots = float(getattr(engine, "slots", math.inf))
            return cls(engine, metrics, admission=DecodeAdmission.for_spec(d, slots), kv_bytes=lambda _t: 1.0)
        profile = getattr(engine, "profile", None)
        if not (
            callable(getattr(profile, "kv_budget_bytes", None))
            and callable(getattr(profile, "kv_bytes", None))
        ):
            from easerve_runtime.profiles import spec_profile

            profile = spec_profile(spec)
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
        if "kv_chunk" in request:  # a piece of a KV cache that a request will claim (see wire.py)
            try:
                c = request["kv_chunk"]
                self._kv_in.setdefault(str(c["id"]), {})[int(c["seq"])] = b64d(c["b64"])
            except (KeyError, ValueError, TypeError) as exc:
                yield {"error": f"decode: bad KV chunk: {exc}"}
                return
            yield {"ack": True}
            return
        entered = time.perf_counter()
        try:
            rid = str(request["id"])
            kv: bytes | bytearray | mmap.mmap | None = None
            kv_ipc: dict[str, Any] | None = None
            if "kv_ipc" in request:  # the prefill's device tensor, on this GPU (engines.kv_ipc)
                try:
                    kv_ipc = self._check_share(request["kv_ipc"])
                except KVIPCRefused as exc:  # before anything else: the prefill sends host bytes instead
                    yield {"error": f"decode: {exc}", "kv_ipc_refused": True}
                    return
            elif "kv_blob" in request:
                if self.blobs is None:
                    raise ValueError("a same-host KV blob was sent, but this worker has no blob directory")
                kv = await self.blobs.take(str(request["kv_blob"]), mapped=True)  # no copy: mapped
            elif "kv_chunks" in request:
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
                stop_token_ids=() if request.get("ignore_eos") else self.stop_token_ids,
                sampling=Sampling.from_wire(request),
                kv=kv,
                kv_meta=dict(request.get("kv_meta") or {}),
                kv_ipc=kv_ipc,
            )
            kv_bytes = int(request.get("kv_bytes", 0))
        except (KeyError, ValueError, TypeError) as exc:
            yield {"error": f"decode: bad request: {exc}"}
            return
        await self.engine.receive_kv(kv_bytes)
        q: asyncio.Queue[Any] = asyncio.Queue()
        need = float(self.kv_bytes(seq.context_tokens + seq.max_tokens))
        if self._stage is not None and (seq.kv is not None or seq.kv_ipc is not None):
            task = self._stage(seq)
            if task is None:
                self._unstaged[rid] = seq  # staged later, when a buffer frees up
            else:
                try:  # joins the queue once its cache is on the device; a failed copy fails at admission
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    getattr(self.engine, "discard", lambda _rid: None)(rid)
                    raise
                except KVIPCRefused as exc:  # the driver would not map it: the prefill sends host bytes
                    getattr(self.engine, "discard", lambda _rid: None)(rid)
                    yield {"error": f"decode: {exc}", "kv_ipc_refused": True, "kv_ipc_mapped": exc.mapped}
                    return
                except Exception:  # noqa: BLE001 - reported by admit, which awaits the same task
                    pass
                if seq.kv_ipc is not None:  # copied: the prefill may drop its tensor now, not at the first token
                    yield {"kv_taken": True}
        self._entered[rid] = entered
        self.admission.add((seq, q, need), need)
        self._gauges()
        self._arrival.set()
        ok, finished = True, False
        watch = on_context_stop(context, lambda: q.put_nowait(_STOPPED))
        try:
            while True:
                item = await q.get()
                if item is _STOPPED:
                    return  # the caller stopped the request (finally: it leaves the batch)
                if item is None:
                    break
                if isinstance(item, Exception):
                    ok = False
                    finished = True
                    if isinstance(item, KVIPCRefused):  # at admission, before any token: host bytes follow
                        yield {"error": f"decode: {item}", "kv_ipc_refused": True, "kv_ipc_mapped": item.mapped}
                        return
                    yield {"error": f"decode failed: {item}"}
                    break
                yield {"token": item}
            finished = True
            if ok and seq.stopped:
                yield {"finish_reason": "stop"}
            self.metrics.stage_requests.labels(self.stage, "ok" if ok else "error").inc()
        finally:
            if watch is not None:
                watch.cancel()
            if not finished and not seq.done:  # a finished sequence leaves the batch by itself
                self._cancel(rid)

    def _check_share(self, desc: Any) -> dict[str, Any]:
        """``desc`` if this engine can map that same-GPU cache when it stages it; ``KVIPCRefused`` if not."""
        check = getattr(self.engine, "check_kv_share", None)
        if check is None or not isinstance(desc, dict):
            raise KVIPCRefused("this decode engine takes no same-GPU KV shares")
        check(desc)
        return desc

    def _cancel(self, rid: str) -> None:
        """The request's caller went away (its stream was closed, or its Dynamo context stopped):
        the sequence leaves the batch at the next step boundary, or is dropped at admission if it
        still waits, and its KV memory is freed. Decoding on for nobody would hold a batch slot
        and its cache until max_tokens."""
        self._cancelled.add(rid)
        self._unstaged.pop(rid, None)
        self.metrics.stage_requests.labels(self.stage, "cancelled").inc()
        self._arrival.set()

    def _gauges(self) -> None:
        waiting = self.admission.waiting
        self.metrics.queue_depth.labels(self.stage).set(waiting)
        self.metrics.inflight.labels(self.stage).set(waiting + len(self._running))

    def _prestage(self) -> None:
        """Stage waiting caches still on the host, oldest first, while the engine has buffers free."""
        if self._stage is None:
            return
        for rid, seq in list(self._unstaged.items()):
            if (seq.kv is None and seq.kv_ipc is None) or self._stage(seq) is not None:
                del self._unstaged[rid]
            else:
                break

    def _write_stats(self, now: float, force: bool = False) -> None:
        self._stats.write(now, lambda: {"running": len(self._running), "waiting": self.admission.waiting,
                                        "loop": dict(self.loop_stats), "engine": getattr(self.engine, "stats", None)},
                          force)

    async def run(self) -> None:
        ls = self.loop_stats
        clock = time.perf_counter
        t_loop = clock()
        while True:
            t0 = clock()
            ls["loop_s"] += t0 - t_loop
            t_loop = t0
            for entry, need in self.admission.admit():
                seq, q, _ = entry
                self._unstaged.pop(seq.request_id, None)
                entered = self._entered.pop(seq.request_id, None)
                if entered is not None:
                    ls["handoff_s"] += t0 - entered
                if seq.request_id in self._cancelled:  # went away while it waited
                    self._cancelled.discard(seq.request_id)
                    getattr(self.engine, "discard", lambda _rid: None)(seq.request_id)
                    self.admission.finish(need)
                    continue
                if seq.done:
                    q.put_nowait(None)
                    self.admission.finish(need)
                    continue
                if self.slots is not None:  # admission counted the slot; load the KV into it
                    try:
                        await self.slots.admit(seq)
                    except Exception as exc:
                        q.put_nowait(exc)
                        self.admission.finish(need)
                        continue
                ls["admitted"] += 1
                self._running.append(entry)
            self._prestage()
            self._gauges()
            t1 = clock()
            ls["admit_s"] += t1 - t0
            if self._cancelled and self._running:
                self._drop_cancelled()
            if not self._running:
                self._write_stats(t1, force=True)
                self._arrival.clear()
                await self._arrival.wait()
                ls["idle_s"] += clock() - t1
                continue
            batch = [s for s, _, _ in self._running]
            self.metrics.decode_batch_size.observe(len(batch))
            ls["iterations"] += 1
            try:
                tokens = await self.engine.decode_step(batch)
            except Exception as exc:
                log.exception("decode step failed")
                for s, q, need in self._running:
                    q.put_nowait(exc)
                    self._release(s, need)
                self._running.clear()
                continue
            still: list[Entry] = []
            for entry, tok in zip(self._running, tokens, strict=True):
                seq, q, need = entry
                seq.generated.append(tok)
                q.put_nowait(tok)
                if seq.done:
                    q.put_nowait(None)
                    self._release(seq, need)
                else:
                    still.append(entry)
            self._running = still
            t2 = clock()
            ls["step_s"] += t2 - t1
            self._write_stats(t2)

    def _drop_cancelled(self) -> None:
        keep: list[Entry] = []
        for entry in self._running:
            seq, _q, need = entry
            if seq.request_id in self._cancelled:
                self._cancelled.discard(seq.request_id)
                self._release(seq, need)
            else:
                keep.append(entry)
        self._running = keep
        self._gauges()

    def _release(self, seq: DecodeSequence, need: float) -> None:
        self.admission.finish(need)
        if self.slots is not None:
            self.slots.release(seq.request_id)
