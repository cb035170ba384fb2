"""The HTTP frontend: OpenAI-compatible chat completions over the encode pool.

``POST /v1/chat/completions`` validates the request (``workers.openai``), sends it to the encode
worker with the fewest outstanding requests, and relays the token stream as SSE chunks
(``stream: true``) or one JSON response. ``GET /v1/models``, ``/metrics`` (this process'
``easerve_*`` metrics), ``/health`` (ready once an encode instance is visible) and ``/live``.

On SIGTERM the frontend stops accepting connections, lets in-flight requests finish, then shuts
the Dynamo runtime down: no accepted request is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from easerve_runtime.api import RuntimeConfig
from easerve_runtime.metrics import Metrics
from easerve_runtime.workers.openai import MAX_BODY_BYTES, ChatRequest, RequestError, parse_chat_request
from easerve_runtime.workers.pool import StageError, StagePool
from easerve_runtime.workers.wire import part_to_wire

log = logging.getLogger("easerve.frontend")

SHUTDOWN_GRACE_S = 60.0


def render_token(token: int) -> str:
    """Sim tokens have no vocabulary: render each as a short word so text length tracks tokens."""
    return f"t{token} "


def _error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}
    return {"error": {"message": message, "type": kind or kinds.get(status, "server_error"), "code": status}}


class Frontend:
    stage = "frontend"

    def __init__(self, cfg: RuntimeConfig, encode: StagePool | None, metrics: Metrics) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.encode = encode
        self.metrics = metrics
        names = [self.spec.served_model_name, self.spec.model.name]
        self.served_names = tuple(dict.fromkeys(names))
        self.inflight = 0
        self.draining = False
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
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        return app

    # -- small endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": n, "object": "model", "owned_by": "easerve"} for n in self.served_names[:1]]
        return web.json_response({"object": "list", "data": data})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.exposition(), content_type="text/plain")

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.encode.instances()) if self.encode is not None else 0
        ready = n > 0 and not self.draining
        body = {"status": "ready" if ready else "notready", "encode_instances": n, "inflight": self.inflight}
        return web.json_response(body, status=200 if ready else 503)

    # -- chat completions -----------------------------------------------------------------
    def _reject(self, status: int, message: str) -> web.Response:
        self.metrics.requests.labels("rejected").inc()
        return web.json_response(_error_body(status, message), status=status)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        if self.draining:
            return self._reject(503, "server is shutting down")
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            return self._reject(413, f"request body: larger than {MAX_BODY_BYTES} bytes")
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            return self._reject(400, f"request body: not valid JSON ({exc})")
        try:
            req = parse_chat_request(body, self.served_names, str(self.spec.model.modality))
        except RequestError as exc:
            return self._reject(exc.status, exc.message)
        if self.encode is None:
            return self._reject(503, "no encode pool")
        self.inflight += 1
        self.metrics.inflight.labels(self.stage).set(self.inflight)
        try:
            if req.stream:
                return await self._stream(request, req, t0)
            return await self._unary(req, t0)
        finally:
            self.inflight -= 1
            self.metrics.inflight.labels(self.stage).set(self.inflight)

    def _wire(self, req: ChatRequest, rid: str) -> dict[str, Any]:
        return {
            "id": rid,
            "seed": req.seed,
            "text_tokens": req.text_tokens,
            "max_tokens": req.max_tokens,
            "priority": req.priority,
            "parts": [part_to_wire(p) for p in req.parts],
            "messages": req.messages,
            "temperature": req.temperature,
            "top_p": req.top_p,
        }

    def _finish(self, ok: bool, t0: float, first: float | None, last: float | None, n: int) -> None:
        m = self.metrics
        m.requests.labels("ok" if ok else "error").inc()
        if not ok:
            return
        m.e2e.observe(time.monotonic() - t0)
        if first is not None:
            ttft = first - t0
            tpot = (last - first) / (n - 1) if last is not None and n > 1 else 0.0
            m.ttft.observe(ttft)
            if last is not None and n > 1:
                m.tpot.observe(tpot)
            for tier in self.spec.slo.tiers:  # goodput: a request is good when its own TTFT and TPOT fit
                if ttft <= tier.ttft_seconds and tpot * 1e3 <= tier.tpot_ms:
                    m.goodput.labels(tier.name).inc()

    async def _tokens(self, req: ChatRequest, rid: str) -> Any:
        """Yield ('token', id) ... then ('done', info); raise StageError on failure."""
        assert self.encode is not None
        async for item in self.encode.stream(self._wire(req, rid)):
            if "error" in item:
                raise StageError(str(item["error"]))
            if "token" in item:
                yield "token", int(item["token"])
            elif item.get("done"):
                yield "done", item
                return
        raise StageError("encode stream ended before the request finished")

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _unary(self, req: ChatRequest, t0: float) -> web.Response:
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tokens: list[int] = []
        first = last = None
        info: dict[str, Any] = {}
        try:
            async for kind, val in self._tokens(req, rid):
                if kind == "token":
                    last = time.monotonic()
                    first = first or last
                    tokens.append(val)
                else:
                    info = val
        except StageError as exc:
            self._finish(False, t0, None, None, 0)
            status = 503 if exc.retryable else 502
            return web.json_response(_error_body(status, str(exc), "upstream_error"), status=status)
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

    async def _stream(self, http: web.Request, req: ChatRequest, t0: float) -> web.StreamResponse:
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

        try:
            async for kind, val in self._tokens(req, rid):
                if not started:
                    await resp.prepare(http)
                    started = True
                if kind == "token":
                    last = time.monotonic()
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
        except StageError as exc:
            self._finish(False, t0, None, None, 0)
            if not started:
                status = 503 if exc.retryable else 502
                return web.json_response(_error_body(status, str(exc), "upstream_error"), status=status)
            err = _error_body(502, str(exc), "upstream_error")
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            self._finish(False, t0, None, None, 0)
            raise
        self._finish(True, t0, first, last, n)
        self.metrics.output_tokens.inc(n)
        return resp
