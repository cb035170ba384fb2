"""A pool of instances of one Dynamo endpoint, picked by fewest outstanding requests.

Dynamo's client offers round-robin and random; the issue asks for the least-loaded instance
(``policies.router.LeastOutstanding``, ties rotating), so we count outstanding requests per
instance here and call ``client.direct``. Two failure cases matter:

- the instance is gone before the call reaches it (``Unavailable: TCP connection ... failed``):
  nothing was processed, so we quarantine it and retry on another instance. With the ``file``
  discovery backend a SIGKILLed worker's key lingers, so without this every ``n``-th request
  would fail until it expires. Quarantine only ranks: while discovery lists nothing else, the
  quarantined instances are still tried, and the first item an instance streams lifts it;
- the stream breaks after items arrived: the request was partly served and cannot be replayed
  silently; the caller gets :class:`StageError` and reports it to its client.

A worker that dies or hangs without closing its streams (SIGSTOP, a wedged event loop) would
leave its callers waiting forever. While a stream is silent the pool re-checks, every
``WATCH_S``, that its instance is still registered: discovery drops an instance whose lease
lapsed (its keep-alive stops with the process), so a hung worker leaves routing within the lease
TTL, and its in-flight requests get an explicit :class:`StageError` at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from easerve_runtime.policies.router import LeastOutstanding, ranked_rotation_start
from easerve_runtime.workers.dynamo_rt import is_unavailable, request_context

QUARANTINE_S = 30.0
MAX_ATTEMPTS = 3
WATCH_S = 1.0
"""How often a silent stream re-checks that its instance is still registered (seconds)."""
HUNG_S = 10.0
"""Silence after which a stream of an unregistered instance is declared lost. A worker that drains
on SIGTERM also withdraws its key first, but it keeps streaming, so silence tells the two apart."""


class StageError(RuntimeError):
    """A downstream stage failed for this request; ``retryable`` if nothing was processed."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class StagePool(Protocol):
    """What workers need from a pool of downstream instances (tests substitute their own)."""

    name: str
    outstanding: dict[int, int]

    def instances(self) -> list[int]: ...

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int: ...

    def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]: ...


class Pool:
    """Instances of one endpoint; ``stream(request)`` sends to the least-loaded live one."""

    def __init__(self, client: Any, name: str, clock: Any = time.monotonic, rotation_start: int = 0) -> None:
        self.client = client
        self.name = name
        self.clock = clock
        self.outstanding: dict[int, int] = {}
        self._quarantine: dict[int, float] = {}
        # each process its own start: pools of different processes count only their own requests
        self._picker = LeastOutstanding(rotation_start)
        self._rank: tuple[int, int] | None = None
        self._phased: tuple[int, int, int] | None = None
        self.watch_s = WATCH_S
        self.hung_s = HUNG_S

    def set_rank(self, rank: int, pickers: int) -> None:
        """This process is picker ``rank`` of ``pickers`` peers that pick from the same instances
        (the deployment's frontends, ``workers.frontend_rank``): the rotation restarts at the rank's
        place in an even spread over the live instances (``ranked_rotation_start``) at the next
        pick, and again whenever the rank, the peers or the instances change."""
        if not 0 <= rank < pickers:
            raise ValueError(f"set_rank: need 0 <= rank < pickers, got {rank}, {pickers}")
        self._rank = (rank, pickers)

    @property
    def rank(self) -> tuple[int, int] | None:
        """(rank, pickers) once known (``set_rank``), else None: the hashed start stands."""
        return self._rank

    def instances(self) -> list[int]:
        """Live instance ids in id order, quarantined ones excluded unless every listed one is.

        Quarantine is a preference, not a verdict: an instance that refused one connection is
        skipped while another is listed, but when discovery lists only quarantined instances they
        are all returned and tried (a call that fails again costs one connect). Excluding them
        would make a frontend whose one encode instance hiccupped report no encode instance on
        ``/health`` for ``QUARANTINE_S`` and be taken out of its Service, refusing every request
        while the instance is serving again.

        Sorted because Dynamo's client lists them in an order of its own per process (a hash map's:
        three processes watching the same four instances saw two or three orders,
        ``benchmarks/instance_order.py``). Pickers that each count only their own requests (every
        encode worker's remote-prefill pick, every frontend's encode pick) start their rotation at
        a position in this list. In a per-process order, whether two encode workers pick in step
        or out of step was a coin toss per deployment, which moved a trial's P99 TTFT by up to
        19 % against the twin (whose workers share one order). In id order every process ranks
        the instances alike, as the twin does."""
        now = self.clock()
        ids = sorted(self.client.instance_ids())
        if self._quarantine:
            for iid, until in list(self._quarantine.items()):
                if until <= now or iid not in ids:
                    del self._quarantine[iid]
            ids = [i for i in ids if i not in self._quarantine] or ids
        return ids

    def quarantine(self, iid: int) -> None:
        self._quarantine[iid] = self.clock() + QUARANTINE_S

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int:
        """The live instance with the fewest outstanding requests (plus ``extra`` not yet sent)."""
        live = self.instances()
        ids = [i for i in live if not exclude or i not in exclude]
        if not ids:
            raise StageError(f"no live {self.name} instance", retryable=True)
        load = self.outstanding
        if extra:
            load = dict(load)
            for k, v in extra.items():
                load[k] = load.get(k, 0) + v
        if self._rank is not None and (phase := (*self._rank, len(live))) != self._phased:
            self._picker.restart(ranked_rotation_start(self._rank[0], self._rank[1], len(live)))
            self._phased = phase
        return self._picker.pick(ids, load)

    @property
    def total_outstanding(self) -> int:
        return sum(self.outstanding.values())

    async def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]:
        """Yield the response items of ``request`` from ``instance`` or the least-loaded live one.

        ``weight`` is how many requests the message carries (an envelope carries several), so
        "outstanding" counts requests, not messages. Retries on another instance only while
        nothing has been received; raises StageError.
        """
        tried: set[int] = set()
        for _attempt in range(MAX_ATTEMPTS):
            if instance is not None and instance in self.instances() and instance not in tried:
                iid = instance
            else:
                iid = self.pick(tried)
            tried.add(iid)
            self.outstanding[iid] = self.outstanding.get(iid, 0) + weight
            received = completed = False
            ctx = request_context(self.client)
            try:
                try:
                    if ctx is None:
                        stream = await self.client.direct(request, iid, annotated=False)
                    else:
                        stream = await self.client.direct(request, iid, annotated=False, context=ctx)
                    async for item in self._watched(stream, iid):
                        if not received:
                            received = True
                            self._quarantine.pop(iid, None)  # it answers: no longer avoided
                        yield item
                    completed = True
                    return
                except StageError:
                    raise
                except Exception as exc:
                    if is_unavailable(exc):
                        self.quarantine(iid)
                        if not received:
                            continue
                    raise StageError(f"{self.name} instance {iid:x} failed: {exc}") from exc
            finally:
                if ctx is not None and not completed:  # we gave up on it: tell the worker
                    with contextlib.suppress(Exception):  # best effort: the stream is dropped anyway
                        ctx.stop_generating()
                n = self.outstanding.get(iid, weight) - weight
                if n > 0:
                    self.outstanding[iid] = n
                else:
                    self.outstanding.pop(iid, None)
        raise StageError(f"no reachable {self.name} instance after {MAX_ATTEMPTS} attempts", retryable=True)

    async def _watched(self, stream: Any, iid: int) -> AsyncIterator[Any]:
        """Items of ``stream``; StageError if ``iid`` leaves discovery while the stream is silent."""
        it = stream.__aiter__()
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            last = self.clock()
            try:
                while True:
                    done, _ = await asyncio.wait({nxt}, timeout=self.watch_s)
                    if done:
                        break
                    if self.clock() - last >= self.hung_s and iid not in self.client.instance_ids():
                        self.quarantine(iid)
                        raise StageError(
                            f"{self.name} instance {iid:x} left discovery and went silent for "
                            f"{self.clock() - last:.0f} s (dead or hung)"
                        )
            except BaseException:
                nxt.cancel()
                raise
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item


class InProcessPool:
    """The local prefill worker running in this very process (``topology.local_prefill_in_encode``:
    the torch engine's encode process hosts its GPU's local prefill), as a :class:`StagePool` of one
    instance, so the encode worker routes, cancels and counts exactly as with the Dynamo pool.

    ``stream`` calls the worker's ``generate`` directly on this event loop; ``in_process`` tells the
    encode worker to hand the envelope's buffer over as it is (no blob, no base64). A failure of the
    handler surfaces as :class:`StageError`, as a broken Dynamo stream does, so every request of the
    envelope gets an explicit error."""

    INSTANCE = 0
    in_process = True

    def __init__(self, worker: Any, name: str = "local prefill") -> None:
        self.worker = worker
        self.name = name
        self.outstanding: dict[int, int] = {}

    def instances(self) -> list[int]:
        return [self.INSTANCE]

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int:
        if exclude and self.INSTANCE in exclude:
            raise StageError(f"no live {self.name} instance", retryable=True)
        return self.INSTANCE

    async def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]:
        iid = self.INSTANCE
        self.outstanding[iid] = self.outstanding.get(iid, 0) + weight
        try:
            async with contextlib.aclosing(self.worker.generate(request)) as items:
                async for item in items:
                    yield item
        except StageError:
            raise
        except Exception as exc:
            raise StageError(f"{self.name} failed: {exc!r}") from exc
        finally:
            n = self.outstanding.get(iid, weight) - weight
            if n > 0:
                self.outstanding[iid] = n
            else:
                self.outstanding.pop(iid, None)
