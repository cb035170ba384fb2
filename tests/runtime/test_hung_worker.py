"""A hung worker (SIGSTOP) under `easerve serve` with real Dynamo processes: its in-flight requests
get an explicit error once its discovery lease lapses, new requests avoid it, and `easerve serve`
still stops on SIGTERM within its budget although a child ignores every signal but SIGKILL.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from easerve_runtime.bench.payloads import png
from easerve_runtime.workers.launcher import STOP_GRACE_S
from serve_process import serve_process

SPEC = str(Path(__file__).with_name("spec_small.yaml"))
MODEL = "llava-hf/llava-v1.6-34b-hf"
pytestmark = pytest.mark.slow


async def stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    img = "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()
    content = [{"type": "text", "text": f"q{i}"}, {"type": "image_url", "image_url": {"url": img}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    tokens, error = 0, None
    async with session.post(f"{url}/v1/chat/completions", json=body | {"stream": True}) as r:
        if r.status != 200:
            return {"tokens": 0, "error": f"HTTP {r.status}"}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                error = obj["error"]["message"]
                break
            if obj["choices"][0]["delta"].get("content"):
                tokens += 1
    return {"tokens": tokens, "error": error}


def test_hung_decode_worker_leaves_routing_and_serve_still_stops(tmp_path: Path) -> None:
    env = {"EASERVE_SIM_SPEEDUP": "1", "EASERVE_SIM_BYTES_SCALE": "0.01"}
    started: list[subprocess.Popen[bytes]] = []
    with serve_process(Path(SPEC).read_text(), tmp_path, env, timeout_s=120, on_start=started.append) as (port, wd):
        url = f"http://127.0.0.1:{port}"
        proc = started[0]
        victim = None
        try:
            procs = json.loads((wd / "processes.json").read_text())["processes"]
            victim = next(p["pid"] for p in procs if p["stage"] == "decode" and p["index"] == 0)

            async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                    first = [asyncio.create_task(stream(s, url, i, 400)) for i in range(6)]
                    await asyncio.sleep(3)  # all decoding (real-time decode: ~25 ms a token)
                    os.kill(victim, signal.SIGSTOP)
                    before = await asyncio.gather(*first)  # every one ends: tokens or an explicit error
                    after = await asyncio.gather(*(stream(s, url, 10 + i, 5) for i in range(6)))
                    return list(before), list(after)

            before, after = asyncio.run(main())
            hung = [r for r in before if r["tokens"] != 400]
            assert hung, "some requests were decoding on the stopped worker"
            assert all(r["error"] and "dead or hung" in r["error"] for r in hung), hung
            assert [r["tokens"] for r in after] == [5] * 6, after  # the hung instance left routing
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(STOP_GRACE_S + 30)  # the stopped child is SIGKILLed once the budget is spent
            assert time.monotonic() - t0 <= STOP_GRACE_S + 30
        finally:
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
