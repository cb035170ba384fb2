"""Reliability: admission (limits, bounded queue), auth, OpenAPI, faults (retry, dead/hung
instances, deadlines, disconnects) and the launcher's supervision.

The frontend runs in-process on a real aiohttp server (the same ``Frontend.app()`` a pod serves);
its encode pool is the test's stand-in for Dynamo (the Dynamo path is covered by
test_serve_integration.py and the benchmarks). Nothing here asserts a timing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import signal
import struct
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from easerve_runtime.api import LimitsSpec, RuntimeConfig, SpecError, load_manifest, parse_spec
from easerve_runtime.bench.payloads import png
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.admission import AdmissionQueue, queue_bound
from easerve_runtime.policies.router import LeastOutstanding
from easerve_runtime.workers.frontend import Frontend, load_api_keys
from easerve_runtime.workers.openai import RequestError, json_depth, parse_chat_request
from easerve_runtime.workers.pool import Pool, StageError

SPEC = "tests/runtime/spec_small.yaml"
MODEL = "llava-hf/llava-v1.6-34b-hf"
NAMES = (MODEL,)


# -- the pure admission policy --------------------------------------------------------------------
def test_queue_bound_from_capacity_and_override() -> None:
    assert queue_bound(2.3, 2.0) == 5
    assert queue_bound(2.3, 2.0, override=40) == 40
    assert queue_bound(0.0, 2.0) == 1 and queue_bound(float("inf"), 2.0) == 1


def test_admission_refuses_beyond_bound_with_retry_after() -> None:
    q = AdmissionQueue(2, capacity_rps=0.5, adaptive=False)
    assert q.admit(0.0).admitted and q.admit(0.0).admitted
    d = q.admit(0.0)
    assert (d.admitted, d.status) == (False, 429)
    assert d.retry_after_s == 2  # one slot drains in 1 / 0.5 s
    assert "2 of 2" in d.reason
    q.first_token(1.0, 1.0)
    assert q.admit(1.0).admitted
    nr = q.admit(1.0, ready=False)
    assert (nr.admitted, nr.status) == (False, 503) and nr.retry_after_s > 0
    assert (q.admitted, q.refused) == (3, 2)
    q.left_early()
    assert q.waiting == 1


def test_admission_bound_follows_measured_delay() -> None:
    q = AdmissionQueue(20, capacity_rps=10.0, queue_seconds=1.0)
    for _ in range(20):
        q.admit(0.0)
    q.first_token(0.0, 0.5)  # the floor: 0.5 s
    assert q.bound == 20 and q.max_bound == 20
    t = 0.0
    for _ in range(30):  # first tokens far beyond floor + budget: the bound shrinks, once per budget
        t += 1.0
        q.admit(t)
        q.first_token(t, 5.0)
    assert 1 <= q.bound < 20
    low = q.bound
    for _ in range(200):  # on time: it grows again
        t += 0.01
        q.admit(t)
        q.first_token(t, 0.6)
    assert low < q.bound
    for _ in range(5000):  # never past the profile's bound
        q.first_token(t, 0.6)
    assert q.bound == q.max_bound == 20


# -- request limits ----------------------------------------------------------------------------
def png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h (only the header: a decompression bomb's signature)."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + b"\x00" * 64


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def chat(*parts: dict[str, Any], text: str = "hi", **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}
    return body | kw


@pytest.mark.parametrize(
    ("body", "limits", "needle"),
    [
        (chat(image_part(png_header(100_000, 100_000))), {}, "maxImagePixels"),
        (chat(*[image_part(png(8, 8))] * 3), {"max_images_per_request": 2}, "maxImagesPerRequest"),
        (chat(text="x" * 200_000), {}, "maxPromptTokens"),
        (chat(max_tokens=9000), {}, "maxOutputTokens"),
        (chat(text="z" * 400, max_tokens=4000), {"max_context_tokens": 4096, "max_prompt_tokens": 100, "max_output_tokens": 4095}, "maxContextTokens"),
    ],
)
def test_limits_refused_with_400_naming_the_limit(body: dict[str, Any], limits: dict[str, Any], needle: str) -> None:
    with pytest.raises(RequestError) as ei:
        parse_chat_request(body, NAMES, "image", LimitsSpec(**limits), lambda p: 2880)
    assert ei.value.status == 400 and f"spec.limits.{needle}" in ei.value.message


def test_media_tokens_count_towards_the_prompt_limit() -> None:
    body = chat(image_part(png(336, 336)), image_part(png(336, 336)))
    lim = LimitsSpec(max_prompt_tokens=5000)
    assert parse_chat_request(body, NAMES, "image", lim, lambda p: 2000).max_tokens > 0
    with pytest.raises(RequestError, match="maxPromptTokens"):
        parse_chat_request(body, NAMES, "image", lim, lambda p: 3000)


def test_pixel_limit_read_from_header_before_decoding() -> None:
    # the payload after the header is not valid base64: refused for its pixels, never decoded
    url = "data:image/png;base64," + base64.b64encode(png_header(50_000, 50_000)).decode() + "!!!!" * 10
    with pytest.raises(RequestError, match="maxImagePixels"):
        parse_chat_request(chat({"type": "image_url", "image_url": {"url": url}}), NAMES, "image", LimitsSpec())


def test_json_depth_is_iterative() -> None:
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    assert json_depth(deep, 32) == 33  # stops counting past the limit, no recursion
    assert json_depth({"a": [1, {"b": 2}]}, 32) == 3


def test_limits_cross_field_rule_names_the_field() -> None:
    _, s = load_manifest(SPEC)
    wire = s.wire()
    wire["limits"] = {"maxPromptTokens": 5000, "maxContextTokens": 4096}
    with pytest.raises((SpecError, ValueError), match="spec.limits.maxPromptTokens"):
        parse_spec(wire)


# -- the frontend, in-process ------------------------------------------------------------------
Handler = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]


class EncodePool:
    """Encode pool stand-in: instance id -> handler; records which instance got what."""

    name = "encode"

    def __init__(self, handlers: dict[int, Handler]) -> None:
        self.handlers = handlers
        self.outstanding: dict[int, int] = {}
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.abandoned = 0  # streams left before their end (the real pool stops their Dynamo context)
        self._picker = LeastOutstanding()

    def instances(self) -> list[int]:
        return sorted(self.handlers)

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int:
        ids = [i for i in self.instances() if not exclude or i not in exclude]
        if not ids:
            raise StageError("no live encode instance", retryable=True)
        return self._picker.pick(ids, self.outstanding)

    async def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]:
        iid = instance if instance is not None else self.pick()
        self.sent.append((iid, request))
        self.outstanding[iid] = self.outstanding.get(iid, 0) + 1
        completed = False
        try:
            async for item in self.handlers[iid](request):
                yield item
            completed = True
        except StageError:
            raise
        except Exception as exc:
            raise StageError(f"encode {iid} failed: {exc}") from exc
        finally:
            self.outstanding[iid] -= 1
            self.abandoned += not completed


def serving(n: int = 3) -> Handler:
    async def h(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for i in range(min(n, int(req["max_tokens"]))):
            yield {"token": 100 + i}
        yield {"done": True, "route": "remote", "prompt_tokens": 7}

    return h


def cfg(**spec_update: Any) -> RuntimeConfig:
    _, s = load_manifest(SPEC)
    wire = s.wire() | spec_update
    return RuntimeConfig(name="t", dynamo_namespace="ns_t", spec=parse_spec(wire))


async def with_frontend(fe: Frontend, fn: Callable[[aiohttp.ClientSession, str], Any]) -> Any:
    server = TestServer(fe.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()


def run(fe: Frontend, fn: Callable[[aiohttp.ClientSession, str], Any]) -> Any:
    return asyncio.run(with_frontend(fe, fn))


def frontend(pool: Any, **kw: Any) -> Frontend:
    spec_update = kw.pop("spec", {})
    return Frontend(cfg(**spec_update), pool, Metrics(), capacity_rps=kw.pop("capacity", 10.0), api_keys=kw.pop("keys", []), **kw)


async def post(s: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, dict[str, Any], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | kw.pop("headers", {})
    async with s.post(f"{url}/v1/chat/completions", data=data, headers=headers, **kw) as r:
        text = await r.text()
        return r.status, json.loads(text) if text.startswith("{") else {"raw": text}, r.headers


def test_bad_input_is_4xx_naming_the_limit() -> None:
    pool = EncodePool({1: serving()})
    fe = frontend(pool)

    async def go(s: aiohttp.ClientSession, url: str) -> list[tuple[int, str]]:
        out = []
        st, b, _ = await post(s, url, chat(), headers={"Content-Type": "text/plain"})
        out.append((st, b["error"]["message"]))
        st, b, _ = await post(s, url, b"[" * 100_000 + b"]" * 100_000)
        out.append((st, b["error"]["message"]))
        st, b, _ = await post(s, url, chat(text="y" * 10_000_000))
        out.append((st, b["error"]["message"]))
        st, b, _ = await post(s, url, b"x" * (33 * 1024 * 1024))
        out.append((st, b["error"]["message"]))
        return out

    (s415, m415), (s_deep, m_deep), (s_big, m_big), (s_body, m_body) = run(fe, go)
    assert s415 == 415 and "application/json" in m415
    assert s_deep == 400 and "maxJsonDepth" in m_deep
    assert s_big == 400 and "maxPromptTokens" in m_big
    assert s_body == 413 and "maxBodyBytes" in m_body
    assert pool.sent == []  # nothing reached the encode pool


def test_queue_full_is_429_with_retry_after_before_any_work() -> None:
    release = asyncio.Event()

    async def slow(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await release.wait()
        async for item in serving()(req):
            yield item

    pool = EncodePool({1: slow})
    fe = frontend(pool, spec={"limits": {"maxQueuedRequests": 2}})

    async def go(s: aiohttp.ClientSession, url: str) -> tuple[list[int], Any, int]:
        first = [asyncio.create_task(post(s, url, chat(max_tokens=2))) for _ in range(2)]
        while len(pool.sent) < 2:
            await asyncio.sleep(0.01)
        st, body, headers = await post(s, url, chat(max_tokens=2))
        release.set()
        done = [r[0] for r in await asyncio.gather(*first)]
        return done, (st, body, headers.get("Retry-After")), len(pool.sent)

    done, (st, body, retry), sent = run(fe, go)
    assert done == [200, 200]
    assert st == 429 and int(retry) >= 1 and "admission queue full" in body["error"]["message"]
    assert sent == 2  # the refused request did no work


def test_not_ready_is_503_with_retry_after() -> None:
    fe = frontend(EncodePool({}))
    st, body, headers = run(fe, lambda s, u: post(s, u, chat()))
    assert st == 503 and int(headers["Retry-After"]) >= 1


def test_retry_before_first_token_on_another_encode_worker() -> None:
    async def broken(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise RuntimeError("prefill instance gone")
        yield {}  # pragma: no cover

    pool = EncodePool({1: broken, 2: serving()})
    pool.outstanding = {2: 5}  # make the broken one the first pick
    fe = frontend(pool)
    st, body, _ = run(fe, lambda s, u: post(s, u, chat(max_tokens=3)))
    assert st == 200 and body["easerve"]["token_ids"] == [100, 101, 102]
    assert [iid for iid, _ in pool.sent] == [1, 2]
    assert all(r["deadline"] > 0 for _, r in pool.sent)  # the deadline travels with the request


def test_failure_after_first_token_is_an_explicit_error_not_a_retry() -> None:
    async def dies(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield {"token": 1}
        raise RuntimeError("decode instance died")

    pool = EncodePool({1: dies, 2: dies})
    fe = frontend(pool)

    async def go(s: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        async with s.post(f"{url}/v1/chat/completions", json=chat(max_tokens=5, stream=True)) as r:
            return r.status, await r.text()

    st, text = run(fe, go)
    assert st == 200 and "decode instance died" in text and text.rstrip().endswith("[DONE]")
    assert len(pool.sent) == 1


def test_deadline_gives_504() -> None:
    async def hangs(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await asyncio.Event().wait()
        yield {}  # pragma: no cover

    fe = frontend(EncodePool({1: hangs}), spec={"limits": {"requestTimeoutSeconds": 0.2}})
    st, body, _ = run(fe, lambda s, u: post(s, u, chat()))
    assert st == 504 and "requestTimeoutSeconds" in body["error"]["message"]
    assert fe.admission.waiting == 0 and fe.inflight == 0


def test_client_disconnect_cancels_downstream_work() -> None:
    cancelled = asyncio.Event()

    async def endless(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            i = 0
            while True:
                i += 1
                yield {"token": i}
                await asyncio.sleep(0.01)
        finally:
            cancelled.set()

    fe = frontend(EncodePool({1: endless}))

    async def go(s: aiohttp.ClientSession, url: str) -> bool:
        async with s.post(f"{url}/v1/chat/completions", json=chat(stream=True)) as r:
            await r.content.readline()
        # the response is closed: the server's next write fails and the generator is closed
        await asyncio.wait_for(cancelled.wait(), 30)
        return True

    assert run(fe, go)


def test_api_key_auth_401_and_no_key_in_logs(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    secret = "sk-test-7f3a9c"
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"other-key\n{secret}\n")
    keys = load_api_keys({"EASERVE_API_KEYS_FILE": str(keyfile)})
    fe = frontend(EncodePool({1: serving()}), keys=keys, spec={"auth": {"apiKeySecret": "llava-keys"}})

    async def go(s: aiohttp.ClientSession, url: str) -> list[int]:
        out = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {secret}"}):
            st, _, h = await post(s, url, chat(max_tokens=2), headers=headers)
            out.append(st)
            if st == 401:
                assert h["WWW-Authenticate"].startswith("Bearer")
        async with s.get(f"{url}/v1/models") as r:
            out.append(r.status)
        async with s.get(f"{url}/metrics") as r:
            assert secret not in await r.text()
        return out

    with caplog.at_level(logging.DEBUG):
        assert run(fe, go) == [401, 401, 200, 401]
    assert secret not in caplog.text
    with pytest.raises(ValueError, match="spec.auth.apiKeySecret"):
        frontend(EncodePool({}), keys=[], spec={"auth": {"apiKeySecret": "llava-keys"}})


def test_openapi_document_comes_from_the_request_models() -> None:
    fe = frontend(EncodePool({1: serving()}))

    async def go(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        async with s.get(f"{url}/openapi.json") as r:
            return dict(await r.json())

    doc = run(fe, go)
    schemas = doc["components"]["schemas"]
    req = schemas["ChatCompletionRequest"]
    assert set(req["required"]) == {"model", "messages"}
    assert "429" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "ContentPart" in schemas and "ChatMessage" in schemas


# -- the pool: dead or hung instances ----------------------------------------------------------
class SilentClient:
    """A Dynamo client whose instance accepts a request and then never answers (a hung worker)."""

    def __init__(self) -> None:
        self.ids = [7]

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    async def direct(self, request: Any, iid: int, annotated: bool = False) -> AsyncIterator[Any]:
        async def gen() -> AsyncIterator[Any]:
            await asyncio.Event().wait()
            yield {}

        return gen()


def test_every_process_ranks_the_instances_alike() -> None:
    """Dynamo's client lists instance ids in an order of its own per process; the pool sorts them,
    so pickers with the same rotation start (every encode worker's remote-prefill pick, as in the
    twin) make the same picks whatever order their clients gave."""

    class Listed:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

        def instance_ids(self) -> list[int]:
            return list(self.ids)

    a, b = Pool(Listed([9, 3, 5]), "prefill"), Pool(Listed([5, 9, 3]), "prefill")
    assert a.instances() == b.instances() == [3, 5, 9]
    assert [a.pick() for _ in range(4)] == [b.pick() for _ in range(4)] == [3, 5, 9, 3]


class Refusing:
    """A Dynamo client whose instances refuse connections while listed in ``down`` (a worker
    restarting, or a connect that failed under load) and otherwise stream one item."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.down: set[int] = set()
        self.calls: list[int] = []

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    async def direct(self, request: Any, iid: int, annotated: bool = False) -> AsyncIterator[Any]:
        self.calls.append(iid)
        if iid in self.down:
            raise RuntimeError(f"Unavailable: TCP connection to 127.0.0.1:{iid} failed")

        async def gen() -> AsyncIterator[Any]:
            yield {"from": iid}

        return gen()


def test_quarantine_ranks_instances_and_never_empties_the_pool() -> None:
    """An instance that refused a connection is avoided while another is listed; when it is the only
    one listed it is still offered (a frontend's ``/health`` counts ``instances()``: excluding it
    made ``/health`` read 503 for 30 s while the instance served again), and its first answer lifts
    the quarantine."""
    now = [0.0]
    client = Refusing([1])
    pool = Pool(client, "encode", clock=lambda: now[0])

    async def one() -> list[Any]:
        return [item async for item in pool.stream({"id": "r"})]

    client.down = {1}
    with pytest.raises(StageError) as ei:
        asyncio.run(one())
    assert ei.value.retryable and client.calls == [1]  # tried once, then nothing else to try
    assert pool.instances() == [1]  # quarantined, but the only one: still counted and offered
    client.down = set()
    assert asyncio.run(one()) == [{"from": 1}]
    client.ids = [1, 2]
    assert pool._quarantine == {}  # its answer lifted the quarantine
    assert sorted(pool.pick() for _ in range(4)) == [1, 1, 2, 2]

    client.down = {2}
    assert asyncio.run(one()) + asyncio.run(one()) == [{"from": 1}, {"from": 1}]  # 2 refused once, retried on 1
    assert pool.instances() == [1]  # while 1 is listed, the quarantined 2 is skipped
    client.ids = [2]
    assert pool.instances() == [2]  # the only one listed: offered again
    now[0] += 31.0
    client.ids = [1, 2]
    assert pool.instances() == [1, 2]  # the quarantine expired
    assert pool.outstanding == {}


def test_a_refused_connect_leaves_the_frontend_ready_and_serving() -> None:
    """The symptom the ranking mends, through the frontend's HTTP port: its one encode instance
    refuses a connection (a restart, a connect lost under load); the request gets an explicit error,
    ``/health`` (the readiness probe's path) stays 200, and the next request is served by the same
    instance at once, not after the 30 s quarantine."""

    class Serving(Refusing):
        async def direct(self, request: Any, iid: int, annotated: bool = False) -> AsyncIterator[Any]:
            await super().direct(request, iid)  # raises while down
            return serving()(request)

    client = Serving([1])
    fe = frontend(Pool(client, "encode"))

    async def go(s: aiohttp.ClientSession, url: str) -> tuple[int, int, Any, int]:
        client.down = {1}
        refused, _, _ = await post(s, url, chat(max_tokens=2))
        async with s.get(f"{url}/health") as r:
            health, body = r.status, await r.json()
        client.down = set()
        served, _, _ = await post(s, url, chat(max_tokens=2))
        return refused, health, body["encode_instances"], served

    refused, health, n, served = run(fe, go)
    assert refused >= 500 and (health, n) == (200, 1)
    # the refused request: the pool's attempt and the frontend's one retry; then the served one
    assert served == 200 and client.calls == [1, 1, 1]


def test_hung_instance_that_leaves_discovery_fails_its_streams() -> None:
    client = SilentClient()
    pool = Pool(client, "decode")
    pool.watch_s, pool.hung_s = 0.01, 0.05

    async def go() -> str:
        async def consume() -> None:
            async for _ in pool.stream({"id": "r"}):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        assert not task.done()  # still registered: silence alone is not death (it may be queueing)
        client.ids = []  # its discovery lease lapsed
        with pytest.raises(StageError) as ei:
            await asyncio.wait_for(task, 30)
        return str(ei.value)

    msg = asyncio.run(go())
    assert "left discovery" in msg
    assert pool.outstanding == {}


# -- the launcher: supervision and a bounded stop ----------------------------------------------
def test_launcher_restarts_with_backoff_and_stops_within_budget(tmp_path: Path) -> None:
    from easerve_runtime.workers import launcher as L

    _, s = load_manifest(SPEC)
    la = L.Launcher("t", s, 0, tmp_path)
    la.procs = la.procs[:2]
    la._cmds = {}
    stubborn = [sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
    for i, p in enumerate(la.procs):
        p.log_path = str(tmp_path / f"{i}.log")
        la._cmds[i] = (stubborn, {})
        la._spawn(i)
    la._write_processes()
    victim = la.procs[0].pid
    la.popen[0].send_signal(signal.SIGKILL)
    la.popen[0].wait()
    la.supervise(now=1000.0)  # noticed: restart scheduled after the first back-off
    assert la.procs[0].pid == victim
    la.supervise(now=1000.0 + L.BACKOFF_MIN_S)
    assert la.procs[0].pid != victim and la.procs[0].restarts == 1
    assert json.loads((tmp_path / "processes.json").read_text())["processes"][0]["restarts"] == 1
    la.popen[0].send_signal(signal.SIGKILL)  # dies again: the back-off doubles
    la.popen[0].wait()
    la.supervise(now=2000.0)
    la.supervise(now=2000.0 + L.BACKOFF_MIN_S)
    assert la.procs[0].restarts == 1
    la.supervise(now=2000.0 + 2 * L.BACKOFF_MIN_S)
    assert la.procs[0].restarts == 2
    la.stop(grace=0.5)  # both ignore SIGTERM: killed once the budget is spent
    assert all(p.poll() is not None for p in la.popen.values())


def test_render_mounts_the_api_key_secret_into_the_frontend_only() -> None:
    from easerve_operator.render import render_children

    _, s = load_manifest("examples/llava-v1.6-34b.yaml")
    wire = s.wire() | {"auth": {"apiKeySecret": "llava-keys", "apiKeySecretKey": "keys"}}
    children = render_children("llava", "serving", "uid-1", parse_spec(wire))
    enc = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("encode"))
    pod = enc["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert vol["secret"] == {"secretName": "llava-keys", "items": [{"key": "keys", "path": "api-keys"}]}
    by_name = {c["name"]: c for c in pod["containers"]}
    fe_env = {e["name"]: e.get("value") for e in by_name["frontend"]["env"]}
    assert fe_env["EASERVE_API_KEYS_FILE"].endswith("/api-keys")
    for name, c in by_name.items():
        mounted = any(m["name"] == "api-keys" for m in c["volumeMounts"])
        assert mounted == (name == "frontend"), name


def test_prescreen_refuses_oversized_text_without_parsing_and_spares_media() -> None:
    from easerve_runtime.workers.openai import prescreen

    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]}).encode()
    with pytest.raises(RequestError, match="maxPromptTokens"):
        prescreen(big + b"{{ not even json", LimitsSpec())
    media = json.dumps(chat(image_part(png(64, 64) + b"\0" * 3_000_000))).encode()
    prescreen(media, LimitsSpec())  # megabytes of base64 are not text


def test_every_attempt_failing_before_first_token_is_503_with_retry_after() -> None:
    async def no_prefill(req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield {"error": "no live prefill instance"}

    pool = EncodePool({1: no_prefill, 2: no_prefill})
    st, body, headers = run(frontend(pool), lambda s, u: post(s, u, chat()))
    assert st == 503 and int(headers["Retry-After"]) >= 1 and "no live prefill instance" in body["error"]["message"]
    assert len(pool.sent) == 2


def test_capacity_is_shared_among_the_frontends(monkeypatch: pytest.MonkeyPatch) -> None:
    from easerve_runtime.workers.frontend import FRONTENDS_ENV, measured_capacity

    c = cfg()
    monkeypatch.delenv("EASERVE_SIM_SPEEDUP", raising=False)
    monkeypatch.setenv(FRONTENDS_ENV, "1")
    whole = measured_capacity(c)
    monkeypatch.setenv(FRONTENDS_ENV, "4")
    assert measured_capacity(c) == pytest.approx(whole / 4)
    monkeypatch.delenv(FRONTENDS_ENV)  # in pods: one frontend per encode pod the operator renders
    from easerve_runtime.topology import frontends_for

    assert measured_capacity(c) == pytest.approx(whole / frontends_for(c.spec))


def test_a_finished_request_reads_its_encode_stream_to_the_end() -> None:
    """The frontend reads each encode stream on past its ``done`` item to the stream's end, so the
    pool never takes a finished request for one it gave up on (and stops its Dynamo context)."""
    pool = EncodePool({1: serving(), 2: serving()})
    fe = frontend(pool)

    async def go(s: aiohttp.ClientSession, url: str) -> list[int]:
        out = []
        for stream in (False, True, False, True):
            st, _, _ = await post(s, url, chat(stream=stream))
            out.append(st)
        return out

    assert run(fe, go) == [200] * 4  # asyncio.run closes any stream left suspended before it returns
    assert len(pool.sent) == 4 and pool.abandoned == 0
