"""The HTTP frontend: OpenAI-compatible chat completions over the encode pool.

``POST /v1/chat/completions`` authenticates (optional API keys, ``spec.auth``), checks the content
type, the body size and the JSON depth, validates the request against the request models and the
deployment's limits (``workers.openai``, ``spec.limits``), admits it through a bounded queue
(``policies.admission``: 429 or 503 with ``Retry-After`` before any work is done), sends it to the
encode worker with the fewest outstanding requests, and relays the token stream as SSE chunks
(``stream: true``) or one JSON response. ``GET /v1/models``, ``/openapi.json`` (generated from the
same request models), ``/metrics``, ``/health`` (ready once an encode instance is visible) and
``/live``.

Every accepted request carries a deadline (``spec.limits.requestTimeoutSeconds``) to every hop; if
it passes, the client gets an explicit 504, never silence. Encode and prefill are idempotent until
the first token (the sim and real engines are seeded per request), so a request whose encode stream
fails before its first token is retried once on another encode worker. A client that disconnects
cancels its downstream stream.

On SIGTERM the frontend stops accepting connections, lets in-flight requests finish, then shuts
the Dynamo runtime down: no accepted request is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from easerve_runtime.api import RuntimeConfig
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.admission import Admission, admission_queue
from easerve_runtime.workers.openai import (
    ChatRequest,
    RequestError,
    json_depth,
    openapi_document,
    parse_chat_request,
    prescreen,
)
from easerve_runtime.workers.pool import StageError, StagePool
from easerve_runtime.workers.wire import media_tokens_for, part_to_wire

log = logging.getLogger("easerve.frontend")

SHUTDOWN_GRACE_S = 60.0
API_KEYS_ENV = "EASERVE_API_KEYS"
API_KEYS_FILE_ENV = "EASERVE_API_KEYS_FILE"
"""Where the pod finds its API keys: a file mounted from the Secret (one key per line) or the env."""
MAX_ATTEMPTS = 2
"""Tries of one request on encode workers while no token was produced (idempotent until then)."""


def render_token(token: int) -> str:
    """Sim tokens have no vocabulary: render each as a short word so text length tracks tokens."""
    return f"t{token} "


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def _error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or _KINDS.get(status, "server_error"), "code": status}}


def load_api_keys(environ: dict[str, str] | None = None) -> list[bytes]:
    """SHA-256 digests of the accepted API keys (file first, then env); [] means no authentication.

    Only digests are kept, so key material never reaches a log line, a metric or a traceback.
    """
    env = os.environ if environ is None else environ
    text = ""
    path = env.get(API_KEYS_FILE_ENV)
    if path:
        with open(path) as f:
            text = f.read()
    elif env.get(API_KEYS_ENV):
        text = env[API_KEYS_ENV]
    keys = [k.strip() for k in text.replace(",", "\n").splitlines() if k.strip()]
    return [hashlib.sha256(k.encode()).digest() for k in keys]


FRONTENDS_ENV = "EASERVE_FRONTENDS"
"""How many frontends share the deployment: one per encode pod in Kubernetes (the default),
one under ``easerve serve`` (the launcher sets it). Each admits its share of the capacity."""


def measured_capacity(cfg: RuntimeConfig) -> float:
    """This frontend's share of the deployment's saturation rate on its profile (x the sim speed-up);
    on fewer host GPUs than the allocation places (``easerve serve`` sets ``EASERVE_SHARED_GPUS``),
    the rate of the pods time-slicing them."""
    from easerve_runtime.profiles.capacity import saturation_rps
    from easerve_runtime.topology import SHARED_GPUS_ENV, frontends_for

    try:
        c = saturation_rps(cfg.spec, host_gpus=int(os.environ.get(SHARED_GPUS_ENV) or 0) or None)
    except Exception as exc:  # noqa: BLE001 - an unknown profile must not stop the frontend
        log.warning("capacity estimate failed (%s); sizing the admission queue from 1 req/s", exc)
        return 1.0
    if str(cfg.spec.engine.backend) == "sim":
        c *= float(os.environ.get("EASERVE_SIM_SPEEDUP", "1") or 1)
    frontends = int(os.environ.get(FRONTENDS_ENV) or frontends_for(cfg.spec))
    return c / max(1, frontends)


class Frontend:
    stage = "frontend"

    def __init__(
        self,
        cfg: RuntimeConfig,
        encode: StagePool | None,
        metrics: Metrics,
        *,
        capacity_rps: float | None = None,
        api_keys: list[bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.limits = cfg.spec.limits
        self.encode = encode
        self.metrics = metrics
        self.clock = clock
        names = [self.spec.served_model_name, self.spec.model.name]
        self.served_names = tuple(dict.fromkeys(names))
        self.inflight = 0
        self.draining = False
        cap = measured_capacity(cfg) if capacity_rps is None else capacity_rps
        self.admission = admission_queue(self.limits, cap)
        bound = self.admission.bound
        self.api_keys = load_api_keys() if api_keys is None else api_keys
        if self.spec.auth.api_key_secret and not self.api_keys:
            raise ValueError(
                f"spec.auth.apiKeySecret is {self.spec.auth.api_key_secret!r} but no keys were found "
                f"(${API_KEYS_FILE_ENV} or ${API_KEYS_ENV})"
            )
        self.media_tokens = media_tokens_for(cfg.spec)
        self._openapi = openapi_document(self.spec.served_model_name)
        log.info("admission queue: %d requests (capacity %.2f req/s)", bound, cap)
        self.tokenizer: Any = None
        if str(self.spec.engine.backend) == "torch" and self.spec.model.path:
            from easerve_runtime.models.loading import load_tokenizer

            self.tokenizer = load_tokenizer(self.spec.model.path, self.spec.model.trust_remote_code)


    def renderer(self) -> Any:
        """Per request: token id -> text delta (the model's tokenizer, incremental; sim: a word per token)."""
        if self.tokenizer is None:
            return render_token
        from easerve_runtime.models.loading import Detokenizer

        return Detokenizer(self.tokenizer).push

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        return app

    # -- small endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        data = [{"id": n, "object": "model", "owned_by": "easerve"} for n in self.served_names[:1]]
        return web.json_response({"object": "list", "data": data})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.exposition(), content_type="text/plain")

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    def ready(self) -> bool:
        n = len(self.encode.instances()) if self.encode is not None else 0
        return n > 0 and not self.draining

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.encode.instances()) if self.encode is not None else 0
        ready = n > 0 and not self.draining
        body = {
            "status": "ready" if ready else "notready",
            "encode_instances": n,
            "inflight": self.inflight,
            "admission": {
                "bound": self.admission.bound,
                "waiting": self.admission.waiting,
                "admitted": self.admission.admitted,
                "refused": self.admission.refused,
            },
        }
        return web.json_response(body, status=200 if ready else 503)

    # -- chat completions -----------------------------------------------------------------
    def _reject(self, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        self.metrics.requests.labels("rejected" if status < 429 else "refused").inc()
        return web.json_response(_error_body(status, message), status=status, headers=headers)

    def _auth(self, request: web.Request) -> web.Response | None:
        """None if the request may pass; a 401 otherwise (constant-time comparison of digests)."""
        if not self.api_keys:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            digest = hashlib.sha256(token.strip().encode()).digest()
            ok = False
            for k in self.api_keys:
                ok |= hmac.compare_digest(digest, k)
            if ok:
                return None
        msg = "missing API key (Authorization: Bearer <key>)" if not token.strip() else "invalid API key"
        return self._reject(401, msg, {"WWW-Authenticate": 'Bearer realm="easerve"'})

    async def _body(self, request: web.Request) -> Any:
        """The decoded JSON body within the body-size and depth limits; RequestError otherwise."""
        lim = self.limits
        if request.content_type != "application/json":
            raise RequestError(415, f"Content-Type: must be application/json, got {request.content_type!r}")
        if request.content_length is not None and request.content_length > lim.max_body_bytes:
            raise RequestError(
                413, f"request body: {request.content_length} bytes exceed spec.limits.maxBodyBytes ({lim.max_body_bytes})"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"request body: larger than spec.limits.maxBodyBytes ({lim.max_body_bytes})") from None
        prescreen(raw, lim)  # an oversized prompt is refused without being parsed
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestError(400, f"request body: JSON nested deeper than spec.limits.maxJsonDepth ({lim.max_json_depth})") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise RequestError(400, f"request body: not valid JSON ({exc})") from None
        if json_depth(body, lim.max_json_depth) > lim.max_json_depth:
            raise RequestError(400, f"request body: JSON nested deeper than spec.limits.maxJsonDepth ({lim.max_json_depth})")
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = self.clock()
        self.metrics.received.inc()  # the offered load, counted on arrival (the autopilot's signal)
        if (denied := self._auth(request)) is not None:
            return denied
        if self.draining:
            return self._reject(503, "server is shutting down", {"Retry-After": "5"})
        # admission first: under overload a refusal costs neither reading nor decoding the body
        decision: Admission = self.admission.admit(self.clock(), self.ready())
        self.metrics.queue_depth.labels(self.stage).set(self.admission.waiting)
        if not decision.admitted:
            return self._reject(decision.status, decision.reason, {"Retry-After": str(decision.retry_after_s)})
        try:
            body = await self._body(request)
            req = parse_chat_request(
                body, self.served_names, str(self.spec.model.modality), self.limits, self.media_tokens
            )
        except RequestError as exc:
            self.admission.left_early()
            self.metrics.queue_depth.labels(self.stage).set(self.admission.waiting)
            return self._reject(exc.status, exc.message)
        except BaseException:
            self.admission.left_early()
            raise
        self.inflight += 1
        self.metrics.inflight.labels(self.stage).set(self.inflight)
        waiting = [True]  # still counted in the admission queue
        admitted_at = self.clock()

        def first_token() -> None:
            if waiting[0]:
                waiting[0] = False
                now = self.clock()
                self.admission.first_token(now, now - admitted_at)
                self.metrics.queue_depth.labels(self.stage).set(self.admission.waiting)

        try:
            if req.stream:
                return await self._stream(request, req, t0, first_token)
            return await self._unary(request, req, t0, first_token)
        finally:
            if waiting[0]:
                self.admission.left_early()
                self.metrics.queue_depth.labels(self.stage).set(self.admission.waiting)
            self.inflight -= 1
            self.metrics.inflight.labels(self.stage).set(self.inflight)

    def _wire(self, req: ChatRequest, rid: str, deadline: float) -> dict[str, Any]:
        return {
            "id": rid,
            "seed": req.seed,
            "text_tokens": req.text_tokens,
            "max_tokens": req.max_tokens,
            "priority": req.priority,
            "deadline": deadline,
            "parts": [part_to_wire(p) for p in req.parts],
            "messages": req.messages,
            "temperature": req.temperature,
            "top_p": req.top_p,
            **({"ignore_eos": True} if req.ignore_eos else {}),
        }

    def _finish(self, ok: bool, t0: float, first: float | None, last: float | None, n: int) -> None:
        m = self.metrics
        m.requests.labels("ok" if ok else "error").inc()
        if not ok:
            return
        m.e2e.observe(self.clock() - t0)
        if first is not None:
            ttft = first - t0
            tpot = (last - first) / (n - 1) if last is not None and n > 1 else 0.0
            m.ttft.observe(ttft)
            if last is not None and n > 1:
                m.tpot.observe(tpot)
            for tier in self.spec.slo.tiers:  # goodput: a request is good when its own TTFT and TPOT fit
                if ttft <= tier.ttft_seconds and tpot * 1e3 <= tier.tpot_ms:
                    m.goodput.labels(tier.name).inc()

    async def _tokens(self, req: ChatRequest, rid: str, on_first: Callable[[], None]) -> Any:
        """Yield ('token', id) ... then ('done', info); raise StageError on failure, TimeoutError at the deadline.

        Before the first token nothing the client saw depends on the attempt, so a failed attempt
        is retried on another encode worker (the request is seeded: same tokens either way).
        """
        assert self.encode is not None
        deadline = time.time() + self.limits.request_timeout_seconds
        tried: set[int] = set()
        for attempt in range(MAX_ATTEMPTS):
            got = False
            instance = None
            with contextlib.suppress(StageError):
                instance = self.encode.pick(tried)
            if instance is None and attempt > 0:  # no other encode worker: the same one again
                with contextlib.suppress(StageError):
                    instance = self.encode.pick()
            if instance is not None:
                tried.add(instance)
            try:
                done: dict[str, Any] | None = None
                async for item in self.encode.stream(self._wire(req, rid, deadline), instance=instance):
                    if done is not None:
                        continue  # the request has finished: nothing after its done item counts
                    if "error" in item:
                        raise StageError(str(item["error"]))
                    if "token" in item:
                        if not got:
                            got = True
                            on_first()
                        yield "token", int(item["token"])
                    elif item.get("done"):
                        done = item  # read on to the stream's end (it follows at once): leaving
                        # here would make the pool stop the Dynamo context of a finished request
                if done is not None:
                    yield "done", done
                    return
                raise StageError("encode stream ended before the request finished")
            except StageError as exc:
                if got:
                    raise
                if attempt + 1 >= MAX_ATTEMPTS:
                    # nothing was served: the client may simply retry (503 + Retry-After), e.g.
                    # while a killed worker is being restarted
                    raise StageError(f"{exc} (before the first token, after {MAX_ATTEMPTS} attempts)", True) from exc
                log.warning("request %s failed before its first token (%s); retrying on another encode worker", rid, exc)
                rid = f"{rid}-r{attempt + 1}"

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _upstream_error(self, exc: BaseException) -> web.Response:
        if isinstance(exc, TimeoutError):
            status = 504
            msg = f"request did not finish within spec.limits.requestTimeoutSeconds ({self.limits.request_timeout_seconds:g} s)"
        else:
            status = 503 if isinstance(exc, StageError) and exc.retryable else 502
            msg = str(exc)
        headers = {"Retry-After": "1"} if status == 503 else None
        return web.json_response(_error_body(status, msg, "upstream_error"), status=status, headers=headers)

    async def _unary(
        self, http: web.Request, req: ChatRequest, t0: float, on_first: Callable[[], None]
    ) -> web.Response:
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tokens: list[int] = []
        first = last = None
        info: dict[str, Any] = {}
        gen = self._tokens(req, rid, on_first)
        try:
            async with asyncio.timeout(self.limits.request_timeout_seconds):
                async for kind, val in gen:
                    if kind == "token":
                        last = self.clock()
                        first = first or last
                        tokens.append(val)
                    else:
                        info = val
                    if http.transport is None or http.transport.is_closing():
                        raise ConnectionResetError("client disconnected")  # cancel the downstream work
        except (StageError, TimeoutError) as exc:
            self._finish(False, t0, None, None, 0)
            return self._upstream_error(exc)
        finally:
            await gen.aclose()
        self._finish(True, t0, first, last, len(tokens))
        self.metrics.output_tokens.inc(len(tokens))
        render = self.renderer()
        text = "".join(render(t) for t in tokens)
        finish = str(info.get("finish_reason") or "length")
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            ],
            "usage": self._usage(int(info.get("prompt_tokens", req.text_tokens)), len(tokens)),
            "easerve": {"route": info.get("route"), "token_ids": tokens},
        }
        return web.json_response(body)

    async def _stream(
        self, http: web.Request, req: ChatRequest, t0: float, on_first: Callable[[], None]
    ) -> web.StreamResponse:
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        started = False
        n = 0
        first = last = None
        render = self.renderer()

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            obj = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        gen = self._tokens(req, rid, on_first)
        try:
            async with asyncio.timeout(self.limits.request_timeout_seconds):
                async for kind, val in gen:
                    if not started:
                        await resp.prepare(http)
                        started = True
                    if kind == "token":
                        last = self.clock()
                        first = first or last
                        delta = {"content": render(val)}
                        if n == 0:
                            delta["role"] = "assistant"
                        n += 1
                        await resp.write(chunk(delta, easerve={"token_id": val}))
                    else:
                        extra: dict[str, Any] = {"easerve": {"route": val.get("route")}}
                        if req.include_usage:
                            extra["usage"] = self._usage(int(val.get("prompt_tokens", req.text_tokens)), n)
                        await resp.write(chunk({}, str(val.get("finish_reason") or "length"), **extra))
            await resp.write(b"data: [DONE]\n\n")
        except (StageError, TimeoutError) as exc:
            self._finish(False, t0, None, None, 0)
            if not started:
                return self._upstream_error(exc)
            err = self._upstream_error(exc)
            assert err.body is not None
            await resp.write(b"data: " + bytes(err.body) + b"\n\n")  # type: ignore[arg-type]
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            self._finish(False, t0, None, None, 0)
            raise  # the generator's close below cancels the downstream stream
        finally:
            await gen.aclose()
        self._finish(True, t0, first, last, n)
        self.metrics.output_tokens.inc(n)
        return resp
