"""The omni-colocated runtime path: an HTTP server whose shared and downstream stages share one GPU.

Real time, asyncio. The two stages are two loops (tasks) over ONE ``OmniEngine`` — the same
clock-free core the twin drives — so the same ``OmniScheduler`` decides every shared-stage step
and the same ``BandwidthThrottle`` picks the SM cap. With the ``sim`` backend each step sleeps
for the profile's duration (times ``time_scale``); a real engine would execute the batch there.

HTTP surface (OpenAI-style, plus the HorizonServe priority field):

- ``POST /v1/chat/completions`` with ``priority`` (0 text, 10 audio, 20 image — or the values
  set in ``spec.omni.classes``) or ``modalities`` (``["text"]``, ``["text", "audio"]``,
  ``["image"]``); optional ``max_tokens`` and an ``easerve`` object with ``prompt_tokens`` /
  ``output_tokens`` / ``total_steps`` to pin the work exactly (the bench client does). With
  ``stream: true`` the first SSE event is sent at the class's first response (token, audio
  chunk or image) and ``[DONE]`` at completion; otherwise one JSON reply at completion. Every
  reply carries ``easerve.{class, first_response_s, slo_s, slo_met}``.
- ``GET /metrics`` (``easerve_omni_*``), ``GET /health``, ``GET /live``, ``GET /v1/omni/slo``.

SLO table: ``--slo-table FILE`` or ``$EASERVE_OMNI_SLO_TABLE`` (JSON from ``easerve
calibrate-slo``), else solo p95 from the twin for the profile; ``sloSeconds`` in the spec wins.
Times are in *model seconds*: with ``time_scale`` < 1 the server runs faster than real time and
reports latencies unscaled, so SLOs keep their meaning.

Run: ``python -m easerve_runtime.workers.omni -f examples/qwen2.5-omni.yaml --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.omni.engine import Job, OmniEngine
from easerve_runtime.omni.metrics import OmniMetrics
from easerve_runtime.omni.profile import load_omni_profile
from easerve_runtime.omni.replay import solo_p95
from easerve_runtime.omni.systems import make_engine
from easerve_runtime.policies.omni import ClassInfo, SLOTable, class_for_priority, class_table
from easerve_runtime.profiles import profile_path

SLO_ENV = "EASERVE_OMNI_SLO_TABLE"
MODALITY_TO_OUTPUT = {"image": "image", "audio": "audio"}


def load_slo(spec: EPDDeploymentSpec, path: str | None) -> SLOTable:
    """The SLO table from a calibration file if given, else the twin's solo p95 for the profile."""
    assert spec.omni is not None
    path = path or os.environ.get(SLO_ENV)
    if path:
        measured = SLOTable.from_json(Path(path).read_text())
        return SLOTable.from_spec(spec.omni, measured.solo_p95_s)
    return SLOTable.from_spec(spec.omni, solo_p95(load_omni_profile(profile_path(spec)), spec.omni))


def pick_class(classes: dict[str, ClassInfo], body: dict[str, Any]) -> ClassInfo:
    """Class from ``priority``, else from ``modalities``; errors name the field."""
    if "priority" in body and body["priority"] is not None:
        p = body["priority"]
        if not isinstance(p, int) or isinstance(p, bool):
            raise ValueError(f"priority: must be an integer, got {p!r}")
        return class_for_priority(classes, p)
    mods = body.get("modalities") or ["text"]
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        raise ValueError(f"modalities: must be a list of strings, got {mods!r}")
    output = next((MODALITY_TO_OUTPUT[m] for m in mods if m in MODALITY_TO_OUTPUT), "text")
    for c in classes.values():
        if c.output == output:
            return c
    raise ValueError(f"modalities: no class in spec.omni.classes produces {output!r} output")


def _int_field(d: dict[str, Any], key: str, where: str, default: int) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{where}{key}: must be a non-negative integer, got {v!r}")
    return v


class OmniServer:
    """The engine plus its two stage loops, in real time."""

    def __init__(
        self, spec: EPDDeploymentSpec, slo: SLOTable, system: str = "horizon", time_scale: float = 1.0
    ):
        if spec.omni is None:
            raise ValueError("spec.omni: required in omni-colocated mode")
        if not time_scale > 0:
            raise ValueError(f"time_scale: must be > 0, got {time_scale}")
        self.spec = spec
        self.profile = load_omni_profile(profile_path(spec))
        self.classes = class_table(spec.omni.classes)
        self.slo = slo
        self.metrics = OmniMetrics()
        for c in self.classes:
            self.metrics.slo_seconds.labels(c).set(slo.seconds(c))
        self.engine: OmniEngine = make_engine(self.profile, spec.omni, slo, system, self._on_first)
        self.time_scale = time_scale
        self.t0 = time.monotonic()
        self.first_waiters: dict[str, asyncio.Future[float]] = {}
        self.done_waiters: dict[str, asyncio.Future[float]] = {}
        self.wake = {"shared": asyncio.Event(), "down": asyncio.Event()}
        self.seq = 0
        self.tasks: list[asyncio.Task[None]] = []

    def now(self) -> float:
        return (time.monotonic() - self.t0) / self.time_scale

    def _on_first(self, job: Job, now: float) -> None:
        lat = now - job.req.arrival
        self.metrics.first(job.req.cls, lat, self.slo.seconds(job.req.cls))
        fut = self.first_waiters.pop(job.req.id, None)
        if fut is not None and not fut.done():
            fut.set_result(lat)

    def _check_done(self, now: float) -> None:
        for rid in [r for r in self.done_waiters if self.engine.jobs[r].done is not None]:
            fut = self.done_waiters.pop(rid)
            if not fut.done():
                fut.set_result(now)
            self.engine.jobs.pop(rid, None)  # bounded memory on a long-running server

    def _kick(self) -> None:
        for ev in self.wake.values():
            ev.set()

    async def _stage(self, which: str, start: str, finish: str) -> None:
        eng = self.engine
        wake = self.wake[which]
        while True:
            wake.clear()
            d = getattr(eng, start)(self.now())
            if d is None:
                await wake.wait()
                continue
            if start == "start_shared":
                plan = eng.last_plan
                self.metrics.step(
                    plan.n if plan else 0, plan.hidden if plan else 0, eng.shared_sms, eng.stats.bw_ewma
                )
            await asyncio.sleep(d * self.time_scale)
            getattr(eng, finish)(self.now())
            self._check_done(self.now())
            self._kick()  # the other stage may have work now (hand-off, or contention changed)

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._stage("shared", "start_shared", "finish_shared")),
            asyncio.create_task(self._stage("down", "start_down", "finish_down")),
        ]

    async def submit(self, body: dict[str, Any]) -> tuple[Job, asyncio.Future[float], asyncio.Future[float]]:
        info = pick_class(self.classes, body)
        ext = body.get("easerve") or {}
        if not isinstance(ext, dict):
            raise ValueError("easerve: must be an object")
        cp = self.profile.classes.get(info.name) or next(
            c for c in self.profile.classes.values() if c.output == info.output
        )
        text = json.dumps(body.get("messages", ""))
        prompt = _int_field(ext, "prompt_tokens", "easerve.", max(16, len(text) // 4))
        out = _int_field(
            ext, "output_tokens", "easerve.", _int_field(body, "max_tokens", "", int(cp.output_tokens.mean))
        )
        steps = _int_field(ext, "total_steps", "easerve.", int(cp.total_steps.mean))
        self.seq += 1
        rid = f"req-{self.seq}"
        loop = asyncio.get_running_loop()
        first: asyncio.Future[float] = loop.create_future()
        done: asyncio.Future[float] = loop.create_future()
        self.first_waiters[rid] = first
        self.done_waiters[rid] = done
        job = self.engine.submit(rid, info.name, prompt, max(1, out), steps, self.now())
        self._kick()
        return job, first, done


def build_app(server: OmniServer) -> Any:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body: must be a JSON object")
            job, first, done = await server.submit(body)
        except (ValueError, json.JSONDecodeError) as exc:
            return web.json_response(
                {"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400
            )
        cls = job.req.cls
        slo = server.slo.seconds(cls)

        def info(lat: float) -> dict[str, Any]:
            return {"class": cls, "first_response_s": lat, "slo_s": slo, "slo_met": lat <= slo}

        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            lat = await first
            chunk = {
                "id": job.req.id,
                "object": "chat.completion.chunk",
                "easerve": info(lat),
                "choices": [
                    {"index": 0, "delta": {"content": f"<first {server.classes[cls].output} output>"}}
                ],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await done
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        lat = await first
        await done
        return web.json_response(
            {
                "id": job.req.id,
                "object": "chat.completion",
                "model": server.spec.served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": f"<{server.classes[cls].output} output>"},
                    }
                ],
                "easerve": info(lat),
            }
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=server.metrics.exposition(), content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def slo(_: web.Request) -> web.Response:
        return web.Response(text=server.slo.to_json(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/live", health)
    app.router.add_get("/v1/omni/slo", slo)
    return app


async def _serve(
    spec: EPDDeploymentSpec, port: int, slo_path: str | None, time_scale: float, host: str
) -> None:
    from aiohttp import web

    server = OmniServer(spec, load_slo(spec, slo_path), time_scale=time_scale)
    server.start()
    runner = web.AppRunner(build_app(server))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(
        f"easerve omni: serving {spec.served_model_name} on http://{host}:{port} "
        f"(SLOs {server.slo.as_dict()})",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def serve(
    name: str,
    spec: EPDDeploymentSpec,
    port: int,
    *,
    slo_table: str | None = None,
    time_scale: float = 1.0,
    host: str = "0.0.0.0",
) -> int:
    """Serve an omni-colocated deployment until interrupted; what ``easerve serve`` dispatches to."""
    if spec.mode != "omni-colocated" or spec.omni is None:
        print(f"easerve serve: {name}: spec.mode must be omni-colocated with spec.omni set", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(spec, port, slo_table, time_scale, host))
    except KeyboardInterrupt:
        return 0
    return 0


async def _idle_downstream(port: int) -> None:
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "note": "sim backend: downstream steps run in omni-shared"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/live", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_stage(stage: str, name: str, spec: EPDDeploymentSpec, port: int | None = None) -> int:
    """Entry point for ``easerve worker --stage omni-shared|omni-downstream`` (the pod's containers).

    ``omni-shared`` serves HTTP (default port 8000) and runs both stage loops. With the ``sim``
    backend ``omni-downstream`` only answers health probes (default port ``$DYN_SYSTEM_PORT`` or
    9091): its steps are simulated inside ``omni-shared``, which owns the one engine state.
    """
    if stage == "omni-shared":
        return serve(name, spec, port or 8000, slo_table=os.environ.get(SLO_ENV))
    if stage == "omni-downstream":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_idle_downstream(port or int(os.environ.get("DYN_SYSTEM_PORT", "9091"))))
        return 0
    print(f"easerve worker: stage: must be omni-shared or omni-downstream, got {stage!r}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from easerve_runtime.api import load_manifest

    p = argparse.ArgumentParser(
        prog="python -m easerve_runtime.workers.omni", description=__doc__.splitlines()[0]
    )
    p.add_argument("-f", "--file", required=True, help="EPDDeployment manifest (spec.mode: omni-colocated)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument(
        "--slo-table", default=None, help=f"SLO table JSON (default: ${SLO_ENV}, else the twin's solo p95)"
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="sleep this fraction of each modelled step")
    args = p.parse_args(argv)
    name, spec = load_manifest(args.file)
    return serve(name, spec, args.port, slo_table=args.slo_table, time_scale=args.time_scale, host=args.host)


if __name__ == "__main__":
    raise SystemExit(main())
