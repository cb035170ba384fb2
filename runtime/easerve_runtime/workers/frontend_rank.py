"""Each frontend's rank among the deployment's frontends, learnt through Dynamo's discovery.

Why: every frontend picks the encode worker of each request with its own ``LeastOutstanding``
rotation, counting only its own requests. Where they all started at one place they picked in
lockstep; a start hashed from the pod and process (``process_rotation_start``) avoids that only by
chance, and the draw is fresh on every roll-out: on the local cluster it moved the LLaVA example's
all-local trial (three frontends over six encoders) from 0.76 to 1.19 of the twin's P99 TTFT (runs
21-26, docs/benchmarks.md). Ranked, frontend ``r`` of ``k`` starts at ``r * n / k`` of the ``n``
encoders (``policies.router.ranked_rotation_start``), the even spread the twin starts from, on
every roll-out. It fixes the start, not the phase: each rotation then moves with its frontend's own
requests, and the first cluster search with ranked frontends (run 27) read that trial inside the
range of the drawn starts.

How: each frontend serves a small endpoint, ``<namespace>.frontend.generate``, that answers its
rank. Its own instance id is its endpoint's ``connection_id()``; the peers are the endpoint's
instances in id order, so every frontend ranks them alike, counting a peer only once it has
answered (a killed frontend's key can outlive it: with ``file`` discovery a new ``easerve serve``
of the same deployment saw its predecessor and ranked itself 1 of 2), and asking a counted peer
again every ``RECHECK_S`` (one killed after it answered stops being counted). The rank is re-read every ``RANK_S``
and handed to the encode pool (``Pool.set_rank``), which restarts its rotation when the rank, the
number of frontends or the number of encoders changes. Until a frontend sees itself listed, its
hashed start stands.

Only where discovery lists a process's instances by lease (``etcd``, ``file``): with the
``kubernetes`` backend instances are published per pod (the pod's system port and metadata), and a
frontend is a second process in the encode pod, so it keeps the hashed start
(``topology.frontends_ranked``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from easerve_runtime.workers.dynamo_rt import ENDPOINT
from easerve_runtime.workers.pool import Pool

log = logging.getLogger("easerve.frontend")

COMPONENT_FRONTEND = "frontend"
RANK_S = 1.0
"""How often a frontend re-reads its peers (seconds): a trial's load starts after every pod is
ready, well after the first read."""
PEER_TIMEOUT_S = 1.0
"""How long a peer has to answer before it is not counted this time (it is asked again at the next
read: a peer just started may be listed before it answers, a lingering key fails at once)."""
RECHECK_S = 5.0
"""How often a peer already counted is asked again (seconds). Why: a frontend SIGKILLed after it
answered leaves its key listed (until its lease lapses on etcd, for good on file discovery), and
counted once, it would inflate every other frontend's count, so their rotations would start at the
wrong places, until their own restart."""
FIRST_RANK_S = 10.0
"""How long a starting frontend waits to see itself listed before it opens its port. Why wait: a
rank that arrives after the first requests restarts the rotation mid-stream, so the picks would
differ from the twin's, whose frontends start ranked, from the first request on."""


def rank_of(me: int, peers: list[int]) -> tuple[int, int] | None:
    """(rank, count) of instance ``me`` among ``peers`` in id order; None until ``me`` is listed."""
    ids = sorted(set(peers))
    return (ids.index(me), len(ids)) if me in ids else None


class FrontendRank:
    """Serves this frontend's rank endpoint and keeps ``pool``'s rank current."""

    def __init__(self, runtime: Any, namespace: str, pool: Pool, every_s: float = RANK_S,
                 recheck_s: float = RECHECK_S) -> None:
        self.endpoint = runtime.endpoint(f"{namespace}.{COMPONENT_FRONTEND}.{ENDPOINT}")
        self.pool = pool
        self.every_s = every_s
        self.recheck_s = recheck_s
        self.rank: tuple[int, int] | None = None
        self._tasks: list[asyncio.Future[Any]] = []
        self._answered: dict[int, float] = {}
        """The peers counted, and when each last answered (loop time)."""

    async def _answer(self, _request: Any, *_: Any) -> AsyncIterator[dict[str, Any]]:
        """What a peer (or an operator debugging a roll-out) reads: this frontend's rank."""
        rank = self.rank
        yield {"instance": self.endpoint.connection_id(), "rank": rank[0] if rank else None,
               "frontends": rank[1] if rank else None}

    async def start(self, first_rank_s: float = FIRST_RANK_S) -> None:
        """Serve the rank endpoint, wait (up to ``first_rank_s``) to see this frontend listed and
        ranked, then keep the rank current in the background."""
        self._tasks.append(asyncio.ensure_future(self.endpoint.serve_endpoint(self._answer)))
        client = await self.endpoint.client()
        deadline = asyncio.get_running_loop().time() + first_rank_s
        while await self.refresh(client) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.rank is None:
            log.warning("frontend rank: not listed after %.0f s; the hashed start stands until it is", first_rank_s)
        self._tasks.append(asyncio.ensure_future(self._follow(client)))

    async def _answers(self, client: Any, iid: int) -> bool:
        """Does instance ``iid`` answer its rank endpoint (a live frontend, not a lingering key)?"""
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                async for _ in await client.direct({}, iid, annotated=False):
                    pass
            return True
        except Exception:  # noqa: BLE001 - unreachable, refused or slow: not counted this time
            return False

    async def refresh(self, client: Any) -> tuple[int, int] | None:
        """Read the peers once (those that answer) and hand a new rank to the pool."""
        me = int(self.endpoint.connection_id())
        listed = [int(i) for i in client.instance_ids()]
        clock = asyncio.get_running_loop().time
        self._answered = {i: t for i, t in self._answered.items() if i in listed}
        for iid in listed:
            if iid == me:
                continue
            last = self._answered.get(iid)
            if last is not None and clock() - last < self.recheck_s:
                continue  # counted, and asked recently enough
            if await self._answers(client, iid):
                self._answered[iid] = clock()
            elif self._answered.pop(iid, None) is not None:
                log.info("frontend rank: peer %x stopped answering; not counted", iid)
        rank = rank_of(me, [i for i in listed if i == me or i in self._answered])
        if rank is not None and rank != self.rank:
            log.info("frontend rank %d of %d", *rank)
            self.pool.set_rank(*rank)
        self.rank = rank or self.rank
        return rank

    async def _follow(self, client: Any) -> None:
        while True:
            try:
                await self.refresh(client)
            except Exception:  # noqa: BLE001 - discovery hiccups must not take the frontend down
                log.exception("frontend rank: reading the peers failed")
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
