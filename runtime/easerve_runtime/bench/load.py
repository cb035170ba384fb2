"""The HTTP load client: replay a workload open-loop against a chat-completions endpoint.

Open loop (each request is sent at its arrival time whether or not earlier ones finished) is
what a Poisson workload means; a closed loop would hide queueing. Every request streams (SSE) so
TTFT and TPOT are measured at the client, and its outcome becomes a
``workload.RequestRecord``: the twin and this client are scored by the same ``summarize``.

A request's TTFT counts from its scheduled arrival, not from when this client got round to
sending it. Why: on a loaded host the client's own loop falls behind its schedule, and timing
from the late send would both hide that wait and spread the trace's bursts, so the tail would
read better than the deployment served (coordinated omission). Twice on a loaded 2-core CI
machine the live P99 TTFT of ``tests/sim/test_agreement.py``'s easy point read 13-16 % under the
twin's, which replays the schedule itself. How far behind the client ran is reported
(``send_lag``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from easerve_runtime.bench.payloads import chat_body
from easerve_runtime.workload.request import Request, RequestRecord

REQUEST_TIMEOUT_S = 600.0
"""Whole-request limit: a request still open after this is a failure, so a run always ends."""
READ_TIMEOUT_S = 120.0
"""Longest silence between two reads of one response before it counts as failed."""


@dataclass
class Outcome:
    record: RequestRecord
    expected_tokens: int
    token_ids: list[int]
    status: int | None = None
    retry_after: str | None = None
    send_lag_s: float = 0.0
    """How long after its scheduled arrival this client sent the request."""


async def fetch_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as r:
        r.raise_for_status()
        data = await r.json()
    return str(data["data"][0]["id"])


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    req: Request,
    model: str,
    t0: float,
    body: dict[str, Any] | None = None,
    scheduled_s: float | None = None,
) -> Outcome:
    """Send one streaming request; never raises (failures become the record's error).

    ``scheduled_s`` (seconds after ``t0``): the request's arrival on the replayed schedule; its
    record's arrival (TTFT's start) is that, however late it is sent. None: the moment it is sent."""
    sent = time.monotonic() - t0
    arrival = sent if scheduled_s is None else scheduled_s
    lag = max(0.0, sent - arrival)
    rec = RequestRecord(id=req.id, arrival_s=arrival, output_tokens=0)
    tokens: list[int] = []
    body = body if body is not None else chat_body(req, model, stream=True)
    status: int | None = None
    retry_after: str | None = None
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            status, retry_after = r.status, r.headers.get("Retry-After")
            if r.status != 200:
                text = await r.text()
                rec.error = f"HTTP {r.status}: {text[:300]}"
                return Outcome(rec, req.output_tokens, tokens, status, retry_after, lag)
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"].get("message", obj["error"]))
                    break
                ext = obj.get("easerve") or {}
                if "route" in ext:
                    rec.route = ext["route"]
                for ch in obj.get("choices", []):
                    # a token arrived: our frontend names its id; text may be empty (part of a
                    # multi-byte character), so other servers' chunks count by their content
                    if "token_id" in ext or ch.get("delta", {}).get("content"):
                        now = time.monotonic() - t0
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        elif rec.second_token_s is None:
                            rec.second_token_s = now
                        rec.finish_s = now
                        tokens.append(int(ext.get("token_id", -1)))
    except TimeoutError:
        rec.error = "client timeout: no complete response in time"
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.output_tokens = len(tokens)
    if rec.error is None and rec.first_token_s is None:
        rec.error = "no tokens received"
    return Outcome(rec, req.output_tokens, tokens, status, retry_after, lag)


async def run_load(
    url: str,
    requests: list[Request],
    model: str | None = None,
    on_done: Callable[[Outcome], None] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    headers: dict[str, str] | None = None,
    on_start: Callable[[float], None] | None = None,
    image_format: str = "png",
    ignore_eos: bool = False,
    connection_per_request: bool = False,
) -> tuple[list[Outcome], float]:
    """Send every request at its ``arrival_s`` (seconds from start); return outcomes and duration.

    Each request has its own ``timeout_s`` (and a read-silence limit), counted as a failure when
    it expires, so the run ends even if the server stops answering.

    By default the requests share one client's keep-alive pool: a request reuses whichever
    connection is free, so behind a Service that deals *connections* across pods (kube-proxy) the
    requests are not dealt one by one. ``connection_per_request`` opens a connection for each, as
    independent users would: the Service then deals the requests themselves.
    """
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=min(timeout_s, READ_TIMEOUT_S))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=connection_per_request), timeout=timeout, headers=headers
    ) as session:
        if model is None:
            model = await fetch_model(session, url)
        # build bodies up front so JSON/base64 work does not delay the arrival schedule
        bodies = [chat_body(r, model, stream=True, image_format=image_format, ignore_eos=ignore_eos) for r in requests]
        t0 = time.monotonic()
        if on_start is not None:  # the clock arrival_s is measured on (e.g. to schedule a fault)
            on_start(t0)
        tasks: list[asyncio.Task[Outcome]] = []

        async def fire(i: int) -> Outcome:
            out = await one_request(session, url, requests[i], model, t0, bodies[i], requests[i].arrival_s)
            if on_done is not None:
                on_done(out)
            return out

        for i, r in enumerate(requests):
            delay = r.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i)))
        outcomes = list(await asyncio.gather(*tasks))
        duration = time.monotonic() - t0
    return outcomes, duration
