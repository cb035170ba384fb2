"""Property-based API fuzzing against a live `easerve serve` (real Dynamo processes, sim engine).

Requests are drawn from the server's own ``/openapi.json`` (the schema generated from the request
models that validate input), plus malformed variants: wrong types, arbitrary JSON, deep nesting,
raw bytes, wrong content types, absurd image headers. Property: no response is a 5xx, and the
server still serves a valid request afterwards. Bounded: ``FUZZ_EXAMPLES`` requests (about a
minute on two busy cores).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.bench.payloads import png
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import serve_process

SPEC = str(Path(__file__).with_name("spec_small.yaml"))
MODEL = "llava-hf/llava-v1.6-34b-hf"
FUZZ_EXAMPLES = int(os.environ.get("EASERVE_FUZZ_EXAMPLES", "150"))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("fuzz")
    env = {"EASERVE_SIM_SPEEDUP": "20", "EASERVE_SIM_BYTES_SCALE": "0.01"}
    with serve_process(Path(SPEC).read_text(), tmp, env, timeout_s=120) as (port, _wd):
        yield f"127.0.0.1:{port}"


def request(host: str, method: str, path: str, body: bytes = b"", ctype: str = "application/json") -> tuple[int, bytes, float]:
    conn = http.client.HTTPConnection(host, timeout=60)
    t0 = time.monotonic()
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        return r.status, r.read(), time.monotonic() - t0
    finally:
        conn.close()


# -- strategies from the OpenAPI document --------------------------------------------------------
def from_schema(schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for a JSON schema (the subset pydantic emits), size-bounded."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs, depth) for s in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "string":
        return st.text(max_size=40)
    if t == "integer":
        lo, hi = schema.get("minimum", -(2**40)), schema.get("maximum", 2**40)
        return st.one_of(st.integers(lo, min(hi, lo + 64)), st.integers(lo, hi))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        req = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k in required}
        opt = {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(req, optional=opt)
    return st.none()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def png_claiming(w: int, h: int) -> str:
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + b"\0" * 32
    return "data:image/png;base64," + base64.b64encode(data).decode()


def valid_body(max_tokens: int = 3) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def cases(doc: dict[str, Any]) -> st.SearchStrategy[tuple[bytes, str]]:
    defs = doc["components"]["schemas"]
    shaped = from_schema(defs["ChatCompletionRequest"], defs).map(
        lambda b: b | ({"model": MODEL} if isinstance(b, dict) and b.get("model") == "" else {})
    )
    as_json = st.one_of(
        shaped,
        shaped.map(lambda b: b | {"model": MODEL}),  # reaches the handlers past the model check
        json_values,
        st.integers(1, 5000).map(lambda n: json.loads("[" * n + "]" * n) if n < 900 else {"deep": n}),
        st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)).map(
            lambda wh: valid_body() | {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_claiming(*wh)}}]}]
            }
        ),
    ).map(lambda b: (json.dumps(b).encode(), "application/json"))
    raw = st.one_of(
        st.binary(max_size=200).map(lambda b: (b, "application/json")),
        st.integers(100, 100_000).map(lambda n: (b"[" * n + b"]" * n, "application/json")),  # RecursionError bait
        st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]).map(
            lambda c: (json.dumps(valid_body()).encode(), c)
        ),
    )
    return st.one_of(as_json, as_json, raw)


def test_fuzz_finds_no_5xx_and_the_server_keeps_serving(server: str) -> None:
    status, raw, _ = request(server, "GET", "/openapi.json")
    assert status == 200
    doc = json.loads(raw)
    seen: dict[int, int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases(doc))
    def one(case: tuple[bytes, str]) -> None:
        body, ctype = case
        st_, out, _ = request(server, "POST", "/v1/chat/completions", body, ctype)
        seen[st_] = seen.get(st_, 0) + 1
        assert st_ < 500, (st_, out[:300], body[:300])

    one()
    # afterwards: still serving, a valid request gets a completion
    status, out, secs = request(server, "POST", "/v1/chat/completions", json.dumps(valid_body()).encode())
    assert status == 200, out[:500]
    assert json.loads(out)["usage"]["completion_tokens"] == 3
    print(f"fuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}; valid request after: {secs:.3f} s")
    assert sum(seen.values()) >= FUZZ_EXAMPLES // 2
    assert 200 in seen and 400 in seen and 415 in seen  # the fuzz reached both sides of validation
