"""``easerve bench --connection-per-request``: one TCP connection per request, so a Service that
balances connections (kube-proxy, the harness's) deals the requests themselves across its pods, as
the twin's front door does. Against a real HTTP server that records each request's client port.
And the open loop's clock: a request's TTFT counts from its scheduled arrival, however late the
client sends it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web
from easerve_runtime.api import load_manifest
from easerve_runtime.bench.load import run_load
from easerve_runtime.workload import generate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llava-v1.6-34b.yaml"


async def serve_and_load(per_request: bool, n: int, spacing_s: float = 0.2,
                         on_start: Any = None, pause_s: float = 0.0) -> tuple[list[int], list[Any]]:
    """Client ports of the chat requests, in order, and the outcomes."""
    ports: list[int] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in (1, 2):
            if tok == 2 and pause_s:  # as a disaggregated server pauses for the KV handoff
                await asyncio.sleep(pause_s)
            chunk = {"choices": [{"delta": {"content": "x"}}], "easerve": {"token_id": tok}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    _, spec = load_manifest(str(EXAMPLE))
    # one after another (0.2 s apart), so a kept-alive connection is free for the next request
    reqs = [replace(r, arrival_s=spacing_s * i) for i, r in enumerate(generate(spec, 1.0, n, 3))]
    try:
        outs, _ = await run_load(f"http://127.0.0.1:{port}", reqs, connection_per_request=per_request,
                                 on_start=on_start)
    finally:
        await runner.cleanup()
    return ports, outs


def ok(outs: list[Any]) -> int:
    return sum(1 for o in outs if o.record.error is None)


def test_a_connection_per_request_and_a_kept_alive_pool() -> None:
    n = 5
    ports, outs = asyncio.run(serve_and_load(True, n))
    assert ok(outs) == n and len(ports) == n
    assert len(set(ports)) == n  # every request on a connection of its own
    pooled, outs = asyncio.run(serve_and_load(False, n))
    assert ok(outs) == n and len(pooled) == n
    assert len(set(pooled)) < n  # the pool reused a connection: a Service would not deal these one by one


def test_a_client_that_falls_behind_its_schedule_still_times_each_request_from_its_arrival() -> None:
    """The client's loop is held for 0.3 s just as the run starts (as a loaded host holds it), so
    every request is sent late: each record's arrival is still its scheduled one, its TTFT takes
    in the wait, and the report says how far behind the client ran."""
    import time

    from easerve_runtime.bench.report import report

    _, outs = asyncio.run(serve_and_load(False, 4, spacing_s=0.01, on_start=lambda _t0: time.sleep(0.3)))
    assert ok(outs) == 4
    assert [o.record.arrival_s for o in outs] == [0.0, 0.01, 0.02, 0.03]
    assert all(o.send_lag_s >= 0.25 for o in outs)
    assert all(o.record.first_token_s - o.record.arrival_s >= o.send_lag_s for o in outs)
    rep = report(outs, 1.0)
    assert rep["send_lag"]["max"] >= 0.25 and rep["ttft_mean"] >= 0.25


def test_the_client_times_the_second_token_apart() -> None:
    """The server pauses 0.2 s between the first token and the second (where a disaggregated server
    hands the KV cache to decode): the record holds that gap and the report gives its statistics."""
    from easerve_runtime.bench.report import report

    _, outs = asyncio.run(serve_and_load(False, 3, spacing_s=0.3, pause_s=0.2))
    assert ok(outs) == 3
    for o in outs:
        r = o.record
        assert r.first_token_s < r.second_token_s <= r.finish_s
        assert r.token2_gap_s >= 0.2
    assert report(outs, 1.0)["token2_gap"]["p50"] >= 0.2
