"""End to end on the CPU: `easerve serve` (real Dynamo processes, file discovery) + `easerve bench`.

Each fixture launches its own deployment in a temp dir on free ports, so concurrent runs never
see each other. The sim engine runs faster than real time (EASERVE_SIM_SPEEDUP) and materialises
1% of the embedding bytes (EASERVE_SIM_BYTES_SCALE) to keep two busy cores out of the way; the
assertions are about counts and outcomes, never timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from easerve_runtime.bench.payloads import png
from serve_process import serve_process

SPEC = str(Path(__file__).with_name("spec_small.yaml"))
DECODING = 3
pytestmark = pytest.mark.slow


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, workdir: Path) -> None:
        self.proc = proc
        self.url = url
        self.workdir = workdir

    def processes(self) -> list[dict[str, Any]]:
        return list(json.loads((self.workdir / "processes.json").read_text())["processes"])

    def find(self, stage: str, index: int = 0) -> dict[str, Any]:
        return next(p for p in self.processes() if p["stage"] == stage and p["index"] == index)

    def metrics(self, port: int | None = None) -> str:
        url = f"http://127.0.0.1:{port}/metrics" if port else f"{self.url}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` whose label set contains ``labels`` (e.g. 'route="remote"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def launch(tmp: Path, speedup: str) -> Iterator[Served]:
    env = {"EASERVE_SIM_SPEEDUP": speedup, "EASERVE_SIM_BYTES_SCALE": "0.01"}
    started: list[subprocess.Popen[bytes]] = []
    try:
        with serve_process(Path(SPEC).read_text(), tmp, env, timeout_s=120, on_start=started.append) as (port, wd):
            url = f"http://127.0.0.1:{port}"
            assert url in (tmp / "serve.log").read_text()  # the URL is logged once healthy
            yield Served(started[0], url, wd)
    finally:
        # no worker may outlive the launcher
        for p in json.loads((tmp / "wd" / "processes.json").read_text())["processes"]:
            try:
                os.kill(p["pid"], 0)
            except ProcessLookupError:
                continue
            os.kill(p["pid"], signal.SIGKILL)
            raise AssertionError(f"{p['stage']}-{p['index']} outlived easerve serve")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from launch(tmp_path_factory.mktemp("serve"), speedup="10")


def bench(url: str, n: int, rate: float, seed: int, output_mean: int, timeout: float = 300) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", url, "--rate", str(rate)]
    cmd += [
        "--requests",
        str(n),
        "--seed",
        str(seed),
        "--output-mean",
        str(output_mean),
        "--prompt-mean",
        "16",
    ]
    cmd += ["--json"]
    out = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    assert out.stdout, out.stderr.decode()[-2000:]
    return dict(json.loads(out.stdout))


def test_sim_keeps_its_separate_local_prefill_process(served: Served) -> None:
    """The sim engine's layout: the local prefill is its own process beside the encode worker (the
    torch engine runs it inside the encode process: tests/engines/test_torch_local_prefill.py)."""
    stages = sorted(p["stage"] for p in served.processes())
    assert stages == ["decode", "decode", "encode", "frontend", "local-prefill", "prefill"]
    assert served.find("local-prefill")["pid"] != served.find("encode")["pid"]


def test_300_requests_counts_and_split(served: Served) -> None:
    enc = served.find("encode")
    fe0, enc0 = served.metrics(), served.metrics(enc["system_port"])
    rep = bench(served.url, 300, rate=40, seed=3, output_mean=4)
    assert rep["completed"] == 300 and rep["failed"] == 0, rep["errors"]
    assert rep["token_count_mismatches"] == 0
    assert rep["ttft"]["mean"] is not None and rep["tpot"]["p99"] is not None
    fe1, enc1 = served.metrics(), served.metrics(enc["system_port"])

    def delta(a: str, b: str, name: str, labels: str = "") -> float:
        return metric(b, name, labels) - metric(a, name, labels)

    assert delta(fe0, fe1, "easerve_requests_total", 'status="ok"') == 300
    assert delta(fe0, fe1, "easerve_output_tokens_total") == rep["output_tokens"]
    assert delta(fe0, fe1, "easerve_ttft_seconds_count") == 300
    remote = delta(enc0, enc1, "easerve_router_routed_total", 'route="remote"')
    local = delta(enc0, enc1, "easerve_router_routed_total", 'route="local"')
    assert remote + local == 300
    assert abs(remote - 150) <= 1, (remote, local)
    assert abs(rep["routes"].get("remote", 0) - 150) <= 1
    assert delta(enc0, enc1, "easerve_encode_batch_size_sum") == 300
    dispatches = delta(enc0, enc1, "easerve_encode_dispatch_total")
    assert dispatches == delta(enc0, enc1, "easerve_encode_batch_size_count") > 0
    assert delta(enc0, enc1, "easerve_envelope_sends_total") <= 2 * dispatches  # one per destination


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_gets_4xx_with_message(served: Served) -> None:
    status, body = post(served.url, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    bad: dict[str, Any] = {
        "model": "llava-hf/llava-v1.6-34b-hf",
        "messages": [{"role": "user", "content": [{"type": "audio_file"}]}],
    }
    status, body = post(served.url, json.dumps(bad).encode())
    assert status == 400 and "messages[0].content[0].type" in body["error"]["message"]
    undecodable = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}
    bad["messages"][0]["content"] = [undecodable]
    status, body = post(served.url, json.dumps(bad).encode())
    assert status == 400 and "undecodable" in body["error"]["message"]
    assert 'easerve_requests_total{status="rejected"}' in served.metrics()


def test_non_streaming_response(served: Served) -> None:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]
    body: dict[str, Any] = {
        "model": "llava-hf/llava-v1.6-34b-hf",
        "messages": [{"role": "user", "content": content}],
    }
    body |= {"max_tokens": 5, "seed": 11, "priority": 7}
    status, out = post(served.url, json.dumps(body).encode())
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 5
    status2, out2 = post(served.url, json.dumps(body).encode())
    assert (
        out2["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]
    )  # deterministic


def test_client_disconnect_stops_the_decode_of_its_request(served: Served) -> None:
    """A client that goes away mid-stream: the frontend stops its Dynamo context, the encode worker
    tells the prefill worker that handed the request on, which stops its decode stream; the
    decode worker drops the sequence at the next step (``cancelled``) instead of decoding the
    other 3,990 tokens for nobody, and its batch is empty again. Counted, not timed."""
    import base64

    decoders = [p for p in served.processes() if p["stage"] == "decode"]

    def cancelled() -> float:
        return sum(metric(served.metrics(p["system_port"]), "easerve_stage_requests_total",
                          'status="cancelled"') for p in decoders)

    def decoding() -> float:
        return sum(metric(served.metrics(p["system_port"]), "easerve_stage_inflight", 'stage="decode"')
                   for p in decoders)

    before = cancelled()
    img = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    body = {"model": "llava-hf/llava-v1.6-34b-hf", "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "long"},
                                                      {"type": "image_url", "image_url": {"url": img}}]}]}

    async def read_some() -> int:
        got = 0
        async with aiohttp.ClientSession() as session, session.post(f"{served.url}/v1/chat/completions",
                                                                    json=body) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                if raw.startswith(b"data:") and b'"content"' in raw:
                    got += 1
                    if got == 5:
                        break  # leave mid-stream: the connection closes with the session
        return got

    assert asyncio.run(read_some()) == 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and cancelled() < before + 1:
        time.sleep(0.2)
    assert cancelled() == before + 1, "the decode worker never learnt that nobody listens"
    while time.monotonic() < deadline and decoding() > 0:
        time.sleep(0.2)
    assert decoding() == 0
    # and the deployment serves on
    st, out = post(served.url, json.dumps({**body, "max_tokens": 3, "stream": False}).encode())
    assert st == 200 and out["usage"]["completion_tokens"] == 3


async def _stream_many(url: str, n: int, max_tokens: int, started: asyncio.Event) -> list[dict[str, Any]]:
    """n concurrent streaming requests; sets ``started`` once every one has ``DECODING`` tokens.

    Token 1 comes from prefill, the rest from decode: with 3 tokens in hand every request is
    being decoded, so a decode worker we strike then certainly holds some of them.
    """
    import base64

    img = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    first = 0

    async def one(session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        nonlocal first
        content = [{"type": "text", "text": f"q{i}"}, {"type": "image_url", "image_url": {"url": img}}]
        body: dict[str, Any] = {
            "model": "llava-hf/llava-v1.6-34b-hf",
            "messages": [{"role": "user", "content": content}],
        }
        body |= {"max_tokens": max_tokens, "stream": True}
        tokens, error = 0, None
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return {"status": r.status, "tokens": 0, "error": await r.text()}
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
                    if tokens == DECODING:
                        first += 1
                        if first == n:
                            started.set()
        return {"status": 200, "tokens": tokens, "error": error}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


def _run_with_signal(url: str, n: int, max_tokens: int, action: Any) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        started = asyncio.Event()
        task = asyncio.create_task(_stream_many(url, n, max_tokens, started))
        await asyncio.wait_for(started.wait(), 60)
        action()
        return await asyncio.wait_for(task, 120)  # no hang: every request ends

    return asyncio.run(main())


@pytest.fixture(scope="module")
def served_slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Real-time decode (a 34B decode step is ~25 ms), so requests are mid-stream when we strike."""
    yield from launch(tmp_path_factory.mktemp("serve-slow"), speedup="1")


def test_sigterm_on_decode_worker_drains(served_slow: Served) -> None:
    victim = served_slow.find("decode", 1)
    results = _run_with_signal(served_slow.url, 8, 60, lambda: os.kill(victim["pid"], signal.SIGTERM))
    assert [r["tokens"] for r in results] == [60] * 8, [r["error"] for r in results]
    assert all(r["error"] is None for r in results)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(victim["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("decode worker did not exit after draining")


def test_sigterm_on_serve_loses_no_accepted_request(served_slow: Served) -> None:
    results = _run_with_signal(served_slow.url, 6, 40, lambda: served_slow.proc.send_signal(signal.SIGTERM))
    assert [r["tokens"] for r in results] == [40] * 6, results
    assert served_slow.proc.wait(60) == 0
    assert re.search(r"stopped", (served_slow.workdir.parent / "serve.log").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def served_kill(tmp_path: Path) -> Iterator[Served]:
    yield from launch(tmp_path, speedup="1")


def test_sigkill_decode_worker(served_kill: Served) -> None:
    victim = served_kill.find("decode", 0)
    results = _run_with_signal(served_kill.url, 8, 80, lambda: os.kill(victim["pid"], signal.SIGKILL))
    failed = [r for r in results if r["error"] or r["tokens"] != 80]
    ok = [r for r in results if not r["error"] and r["tokens"] == 80]
    assert failed, "some requests were decoding on the killed worker"
    assert all(r["error"] for r in failed), failed  # an error response, not a silently short stream
    assert len(failed) + len(ok) == 8
    # new requests succeed on the surviving decode worker (the dead one's key may linger)
    rep = bench(served_kill.url, 20, rate=20, seed=5, output_mean=4)
    assert rep["completed"] == 20 and rep["failed"] == 0, rep["errors"]
