"""The frontends rank themselves through Dynamo's discovery and start their encode rotations evenly
spread (``workers.frontend_rank``, ``Pool.set_rank``), as the twin's frontends start theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from easerve_runtime.policies.router import spread_rotation_starts
from easerve_runtime.workers.frontend_rank import rank_of
from easerve_runtime.workers.pool import Pool

ROOT = Path(__file__).resolve().parents[2]


class Listed:
    """A Dynamo client's view of an endpoint's instances (the pool reads nothing else to pick)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def instance_ids(self) -> list[int]:
        return list(self.ids)


def test_rank_is_the_place_in_id_order_once_listed() -> None:
    assert rank_of(40, [90, 40, 7]) == (1, 3)
    assert rank_of(40, [90, 7]) is None  # not listed yet: the hashed start stands


def test_ranked_pools_start_evenly_spread_like_the_twins_frontends() -> None:
    encoders = [60, 10, 50, 20, 40, 30]  # listed in an order of the client's own
    pools = [Pool(Listed(encoders), "encode", rotation_start=0) for _ in range(3)]
    for rank, pool in enumerate(pools):
        pool.set_rank(rank, 3)
    firsts = [pool.pick() for pool in pools]
    ids = sorted(encoders)
    assert firsts == [ids[s] for s in spread_rotation_starts(6, 3)] == [10, 30, 50]
    # unranked, the three started at one place (here 0) pick in lockstep: the burst the rank prevents
    assert [Pool(Listed(encoders), "encode", rotation_start=0).pick() for _ in range(3)] == [10, 10, 10]


def test_a_ranked_pool_restarts_its_rotation_when_the_encoders_or_peers_change() -> None:
    client = Listed([1, 2, 3, 4])
    pool = Pool(client, "encode")
    pool.set_rank(1, 2)
    assert pool.pick() == 3  # 1 * 4 // 2
    assert pool.pick() == 4  # then the rotation goes on
    client.ids = [1, 2, 3, 4, 5, 6]
    assert pool.pick() == 4  # six encoders: restart at 1 * 6 // 2
    pool.set_rank(2, 3)  # a third frontend joined before this one
    assert pool.pick() == 5  # 2 * 6 // 3
    assert pool.pick() == 6
    with pytest.raises(ValueError, match="rank"):
        pool.set_rank(3, 3)


PEER = """
import asyncio, json, sys
from dynamo._core import DistributedRuntime
from easerve_runtime.workers.frontend_rank import FrontendRank
from easerve_runtime.workers.pool import Pool

class NoEncoders:
    def instance_ids(self):
        return []

async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    pool = Pool(NoEncoders(), "encode")
    rank = FrontendRank(rt, "ns_rank", pool, every_s=0.1, recheck_s=0.5)
    await rank.start()
    at_start = rank.rank  # start() returns once this frontend sees itself listed: ranked before its port opens
    for _ in range(300):
        if rank.rank and rank.rank[1] == int(sys.argv[1]):
            break
        await asyncio.sleep(0.1)
    client = await rank.endpoint.client()
    answer = None
    async for item in await client.direct({}, rank.endpoint.connection_id(), annotated=False):
        answer = item
    print(json.dumps({"me": rank.endpoint.connection_id(), "rank": rank.rank, "pool": pool.rank, "answer": answer,
                      "at_start": at_start}),
          flush=True)
    if len(sys.argv) > 2:  # then wait to count this many (a peer killed after it answered)
        for _ in range(300):
            if rank.rank and rank.rank[1] == int(sys.argv[2]):
                break
            await asyncio.sleep(0.1)
        print(json.dumps({"me": rank.endpoint.connection_id(), "rank": rank.rank, "pool": pool.rank}), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # stay listed (and answering) until every peer has ranked itself
    await rank.stop()
    rt.shutdown()

asyncio.run(main())
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "kv"),
            "DYN_REQUEST_PLANE": "tcp", "DYN_TCP_RPC_HOST": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")])}


def _frontends(tmp_path: Path, n: int, expect: int, then: int | None = None) -> tuple[list[subprocess.Popen[str]], list[dict]]:
    """``n`` frontends that each print their rank once they count ``expect`` frontends (or give up),
    and, with ``then``, again once they count ``then``."""
    extra = [] if then is None else [str(then)]
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(expect), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=_env(tmp_path), text=True) for _ in range(n)]
    lines = []
    deadline = time.monotonic() + 60
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, f"a frontend exited without ranking itself (rc {p.poll()})"
        lines.append(json.loads(line))
        assert time.monotonic() < deadline
    return procs, lines


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.stdin:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_frontends_rank_themselves_through_dynamo_discovery(tmp_path: Path) -> None:
    """Three frontends on Dynamo's file discovery (real endpoints, real clients): each finds itself
    among the three in id order, hands that rank to its encode pool and answers it on its endpoint."""
    procs: list[subprocess.Popen[str]] = []
    try:
        procs, lines = _frontends(tmp_path, 3, 3)
    finally:
        _stop(procs)
    by_id = sorted(lines, key=lambda r: r["me"])
    assert [r["rank"] for r in by_id] == [[0, 3], [1, 3], [2, 3]]
    assert all(r["pool"] == r["rank"] for r in lines)
    assert all(r["at_start"] is not None for r in lines)
    assert all(r["answer"] == {"instance": r["me"], "rank": r["rank"][0], "frontends": 3} for r in lines)


def test_a_killed_frontends_lingering_key_is_not_counted(tmp_path: Path) -> None:
    """A SIGKILLed frontend's key lingers in file discovery; the next frontends count only peers that
    answer, so two of them rank 0 and 1 of 2, not among three."""
    old, _ = _frontends(tmp_path, 1, 1)
    old[0].kill()
    old[0].wait(timeout=20)
    assert any((tmp_path / "kv").rglob("*frontend*"))  # the dead one's key is still listed
    procs: list[subprocess.Popen[str]] = []
    try:
        procs, lines = _frontends(tmp_path, 2, 2)
    finally:
        _stop(procs)
    assert sorted(r["rank"] for r in lines) == [[0, 2], [1, 2]]


def test_a_frontend_killed_after_it_answered_stops_being_counted(tmp_path: Path) -> None:
    """Three frontends rank themselves 0, 1, 2 of 3; the last is SIGKILLed, its key lingering. The
    two left ask their counted peers again (``recheck_s``) and rank themselves 0 and 1 of 2, and
    hand that to their pools."""
    procs: list[subprocess.Popen[str]] = []
    try:
        procs, lines = _frontends(tmp_path, 3, 3, then=2)
        assert sorted(r["rank"] for r in lines) == [[0, 3], [1, 3], [2, 3]]
        victim = next(i for i, r in enumerate(lines) if r["rank"] == [2, 3])
        procs[victim].kill()
        procs[victim].wait(timeout=20)
        assert any((tmp_path / "kv").rglob("*frontend*"))
        after = []
        for i, p in enumerate(procs):
            if i != victim:
                assert p.stdout is not None
                line = p.stdout.readline()
                assert line, f"a frontend exited before re-ranking (rc {p.poll()})"
                after.append(json.loads(line))
    finally:
        _stop([p for p in procs if p.poll() is None])
    assert sorted(r["rank"] for r in after) == [[0, 2], [1, 2]]
    assert all(r["pool"] == r["rank"] for r in after)
