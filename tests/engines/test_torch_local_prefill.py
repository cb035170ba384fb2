"""`easerve serve` of a tiny LLaVA-NeXT torch spec with local prefill: ONE process per encode GPU.

With the torch engine and ``offload.ratio < 1`` the encode process hosts its GPU's local prefill
worker (``topology.local_prefill_in_encode``): no ``local-prefill`` process exists, the encode
worker calls the in-process prefill worker directly, and that worker still hands the KV cache to
the decode process over Dynamo. Checked here on the CPU through the real processes: greedy
replies equal transformers' own ``generate`` at s = 0 (every prefill local) and s = 0.5 (both
routes), the local prefill's metrics come from the encode process, a client that leaves stops its
local request, and a killed encode process gives its request an explicit error and is restarted.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_process import serve_process

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

SPEC = """apiVersion: easerve.io/v1alpha1
kind: EPDDeployment
metadata: {{name: tiny-local}}
spec:
  model: {{name: tiny-llava, modality: image, encoder: clip-vit-l-336, path: {path}}}
  engine: {{backend: torch, profile: llava-v1.6-34b@h200}}
  decode: {{kvMemoryFraction: 0.01}}
  gpuBudget: 3
  allocation: {{encode: {{replicas: 1}}, prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
  encode: {{batchBound: 4, dispatch: eager}}
  offload: {{ratio: {ratio}}}
  smPartition: {{mode: dynamic}}
  slo: {{objective: m, tiers: [{{name: m, ttftSeconds: 30, tpotMs: 1000}}]}}
  discovery: {{backend: file}}
"""
MAX_TOKENS = 10


class Served:
    def __init__(self, url: str, workdir: Path, ratio: float) -> None:
        self.url = url
        self.workdir = workdir
        self.ratio = ratio

    def processes(self) -> list[dict[str, Any]]:
        return list(json.loads((self.workdir / "processes.json").read_text())["processes"])

    def encode(self) -> dict[str, Any]:
        return next(p for p in self.processes() if p["stage"] == "encode")

    def metric(self, port: int, name: str, labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and labels in line)


@pytest.fixture(scope="module", params=[0.0, 0.5], ids=["s0", "s0.5"])
def served(request: pytest.FixtureRequest, model_dirs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    ratio = float(request.param)
    tmp = tmp_path_factory.mktemp(f"torch-local-{ratio}")
    env = {"EASERVE_DEVICE": "cpu", "EASERVE_TORCH_MAX_LEN": "1536", "OMP_NUM_THREADS": "1"}
    with serve_process(SPEC.format(path=model_dirs["llava-next"], ratio=ratio), tmp, env) as (port, wd):
        yield Served(f"http://127.0.0.1:{port}", wd, ratio)


def _image() -> Any:
    from PIL import Image

    return Image.fromarray((np.random.default_rng(5).random((40, 56, 3)) * 255).astype("uint8"))


def _messages() -> list[dict[str, Any]]:
    buf = io.BytesIO()
    _image().save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe this picture."}]}]


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> list[int]:
    """transformers' own greedy generate of the same directory, prompt and image (up to its EOS)."""
    import torch
    import transformers
    from easerve_runtime.models.loading import load_processor

    d = model_dirs["llava-next"]
    proc = load_processor(d)
    model = getattr(transformers, transformers.AutoConfig.from_pretrained(d).architectures[0]).from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture."}]}]
    inp = proc(images=[_image()], text=[proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)],
               return_tensors="pt")
    with torch.inference_mode():
        out = model.eval().generate(**inp, max_new_tokens=MAX_TOKENS, do_sample=False)
    ref = out[0, inp["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]


def _ask(served: Served, max_tokens: int = MAX_TOKENS) -> Any:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", timeout=120)
    return client.chat.completions.create(model="tiny-llava", messages=_messages(), max_tokens=max_tokens,
                                          temperature=0)


def test_one_process_hosts_encode_and_local_prefill_and_equals_generate(served: Served,
                                                                        reference: list[int]) -> None:
    stages = sorted(p["stage"] for p in served.processes())
    assert stages == ["decode", "encode", "frontend", "partition-controller", "prefill"]  # no local-prefill
    enc = served.encode()
    before = served.metric(enc["system_port"], "easerve_stage_requests_total", 'stage="local-prefill",status="ok"')
    routes = []
    for _ in range(4):
        r = _ask(served)
        assert r.model_extra["easerve"]["token_ids"] == reference
        routes.append(r.model_extra["easerve"].get("route"))
    # s = 0: every prefill local; s = 0.5: the deficit router alternates between the two routes
    assert set(routes) == ({"local"} if served.ratio == 0.0 else {"local", "remote"}), routes
    # the in-process local prefill's metrics are the encode process's, under its own stage label
    after = served.metric(enc["system_port"], "easerve_stage_requests_total", 'stage="local-prefill",status="ok"')
    assert after - before == routes.count("local")
    assert served.metric(enc["system_port"], "easerve_stage_inflight", 'stage="local-prefill"') == 0


def _stream_tokens(served: Served, n: int, on_token: Any) -> tuple[int, str | None, bool]:
    """Stream a greedy ``ignore_eos`` request of ``n`` tokens over raw SSE; ``on_token(count)`` may
    return True to stop reading. Returns (tokens, error message, saw [DONE])."""
    body = {"model": "tiny-llava", "messages": _messages(), "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(served.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    tokens, error, done = 0, None, False
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
                break
            if not line.startswith(b"data:"):
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                error = obj["error"]["message"]
                break
            if obj["choices"] and obj["choices"][0]["delta"].get("content") is not None:
                tokens += 1
                if on_token(tokens):
                    break
    return tokens, error, done


def test_a_client_that_leaves_stops_its_local_request(served: Served) -> None:
    """The encode worker's cancel reaches the in-process local prefill (s = 0: every request is
    local), which stops the request's decode stream; the decode worker counts it cancelled."""
    if served.ratio != 0.0:
        pytest.skip("only at s = 0 is the request certainly local")
    decode = next(p for p in served.processes() if p["stage"] == "decode")
    before = served.metric(decode["system_port"], "easerve_stage_requests_total", 'status="cancelled"')
    got, _, _ = _stream_tokens(served, 1300, lambda n: n >= 3)
    assert got == 3
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and served.metric(
            decode["system_port"], "easerve_stage_requests_total", 'status="cancelled"') < before + 1:
        time.sleep(0.1)
    assert served.metric(decode["system_port"], "easerve_stage_requests_total", 'status="cancelled"') == before + 1
    enc = served.encode()
    while time.monotonic() < deadline and served.metric(
            enc["system_port"], "easerve_stage_inflight", 'stage="local-prefill"') > 0:
        time.sleep(0.1)
    assert served.metric(enc["system_port"], "easerve_stage_inflight", 'stage="local-prefill"') == 0


def test_a_killed_encode_process_errors_its_requests_and_is_restarted(served: Served, reference: list[int]) -> None:
    """SIGKILL of the one process running encode and local prefill while a local request decodes:
    that request ends with an explicit error (not silence, not a short [DONE]); the launcher starts
    the process again (one process, as before the kill) and the next request equals generate."""
    if served.ratio != 0.0:
        pytest.skip("only at s = 0 is the request certainly local")
    victim = served.encode()

    def kill_at_third(n: int) -> bool:
        if n == 3:
            os.kill(victim["pid"], signal.SIGKILL)
        return False

    # an explicit SSE error object (a silent stream would end in the client's socket timeout instead)
    got, error, done = _stream_tokens(served, 1300, kill_at_third)
    assert error is not None and not done, (got, error, done)
    assert got < 1300
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and served.encode()["restarts"] < 1:
        time.sleep(0.5)
    enc = served.encode()
    assert enc["restarts"] == 1 and enc["pid"] != victim["pid"]
    assert sorted(p["stage"] for p in served.processes()) == [
        "decode", "encode", "frontend", "partition-controller", "prefill"]
    while True:  # until the restarted process has loaded its engines and registered
        try:
            r = _ask(served)
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert r.model_extra["easerve"]["token_ids"] == reference
