"""The aggregated mode on the torch engine (CPU, the tiny LLaVA-NeXT directory), against
transformers' own generate: in process (the worker over the real HF engines, sharing one copy of
the language model between prefill and decode) and through ``easerve serve`` with the openai client."""

from __future__ import annotations

import asyncio
import base64
import io
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.api import parse_spec
from easerve_runtime.metrics import Metrics
from easerve_runtime.workers.aggregated import AggregatedWorker
from serve_process import serve_process

sys.path.insert(0, str(Path(__file__).parent))
from test_torch_epd import reference_for, request  # noqa: E402 - the E/P/D test's requests and reference

pytestmark = pytest.mark.slow


def agg_spec(path: Path, token_budget: int = 2048) -> Any:
    return parse_spec({
        "model": {"name": "tiny-llava", "modality": "image", "encoder": "clip-vit-l-336", "path": str(path)},
        "engine": {"backend": "torch", "profile": "llava-v1.6-34b@h200"},
        "mode": "aggregated",
        "aggregated": {"tokenBudget": token_budget},
        "decode": {"kvMemoryFraction": 0.01},
        "gpuBudget": 1,
        "slo": {"objective": "m", "tiers": [{"name": "m", "ttftSeconds": 8, "tpotMs": 100}]},
    })


@pytest.fixture(scope="module")
def llava(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llava-next"]


@pytest.fixture(scope="module")
def reference(llava: Path) -> Callable[[int], list[int]]:
    return reference_for(llava)


@pytest.fixture(scope="module")
def engines(llava: Path) -> tuple[Any, Any, Any]:
    from easerve_runtime.engines.hf import HFDecodeEngine, HFEncodeEngine, HFPrefillEngine

    dec = HFDecodeEngine(llava, max_slots=4, max_len=256)
    return HFEncodeEngine(llava), HFPrefillEngine(llava, share=dec), dec


async def ask(w: AggregatedWorker, wire: dict[str, Any], on_token: Callable[[int], Any] | None = None) -> dict[str, Any]:
    tokens: list[int] = []
    async for item in w.generate(wire):
        assert "error" not in item, item
        if "token" in item:
            tokens.append(int(item["token"]))
            if on_token is not None:
                on_token(len(tokens))
        elif item.get("done"):
            return {"tokens": tokens, **item}
    raise AssertionError("stream ended without done")


def test_prefill_shares_the_decode_engines_weights(engines: tuple[Any, Any, Any]) -> None:
    _enc, pre, dec = engines
    assert pre.model is dec.model and pre.keep_local


def test_greedy_equals_generate_and_requests_join_mid_decode(llava: Path, engines: tuple[Any, Any, Any],
                                                             reference: Any) -> None:
    w = AggregatedWorker.for_spec(agg_spec(llava), engines, Metrics())
    assert not w.chunked and w.planner.kv_capacity_bytes == 4  # whole prompts; KV counted in slots

    async def main() -> dict[int, dict[str, Any]]:
        loop = asyncio.create_task(w.run())
        try:
            solo = await ask(w, request(0)[0])
            joined = asyncio.Event()
            first = asyncio.create_task(ask(w, request(2)[0], lambda n: n >= 3 and joined.set()))
            await joined.wait()  # request 2 is decoding: 3 and 4 join its running batch
            rest = await asyncio.gather(ask(w, request(3)[0]), ask(w, request(4)[0]))
            return {0: solo, 2: await first, 3: rest[0], 4: rest[1]}
        finally:
            loop.cancel()

    outs = asyncio.run(main())
    assert w.max_batch >= 2  # they really shared decode steps
    assert len({tuple(o["tokens"]) for o in outs.values()}) > 1
    for i, out in outs.items():
        assert out["tokens"] == reference(i), f"request {i}: {out['tokens']} != generate {reference(i)}"
        assert out["route"] == "aggregated"
    _enc, _pre, dec = engines
    assert not dec.slot_of and w.planner.running == 0 and w.planner.reserved == 0


def test_more_requests_than_slots_wait_and_a_small_budget_spreads_prompts(llava: Path, engines: tuple[Any, Any, Any],
                                                                          reference: Any) -> None:
    """Six requests for four slots: admission waits for a slot; a budget below one prompt runs
    each prompt alone in its iteration (whole prompts: the torch engine does not chunk)."""
    w = AggregatedWorker.for_spec(agg_spec(llava, token_budget=8), engines, Metrics())
    sizes: list[int] = []
    pre = engines[1]
    orig = pre.prefill

    async def recording(batch: Any, share: float = 1.0) -> Any:
        sizes.append(len(batch))
        return await orig(batch, share)

    pre.prefill = recording

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.create_task(w.run())
        try:
            return list(await asyncio.gather(*(ask(w, request(i)[0]) for i in range(6))))
        finally:
            loop.cancel()

    try:
        outs = asyncio.run(main())
    finally:
        del pre.prefill
    assert sizes and max(sizes) == 1
    assert w.max_batch <= 4
    for i, out in enumerate(outs):
        assert out["tokens"] == reference(i)


# -- easerve serve ------------------------------------------------------------------------------
SPEC = """apiVersion: easerve.io/v1alpha1
kind: EPDDeployment
metadata: {{name: tiny-agg}}
spec:
  model: {{name: tiny-llava, modality: image, encoder: clip-vit-l-336, path: {path}}}
  engine: {{backend: torch, profile: llava-v1.6-34b@h200}}
  mode: aggregated
  aggregated: {{tokenBudget: 2048}}
  decode: {{kvMemoryFraction: 0.01}}
  gpuBudget: 1
  slo: {{objective: m, tiers: [{{name: m, ttftSeconds: 30, tpotMs: 1000}}]}}
  discovery: {{backend: file}}
"""


@pytest.fixture(scope="module")
def served(llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("torch-agg")
    env = {"EASERVE_DEVICE": "cpu", "EASERVE_TORCH_MAX_LEN": "1536", "OMP_NUM_THREADS": "1"}
    with serve_process(SPEC.format(path=llava), tmp, env) as (port, _wd):
        yield f"http://127.0.0.1:{port}/v1"


def test_easerve_serve_aggregated_answers_openai_like_generate(served: str, llava: Path, reference: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served, api_key="none", timeout=120)

    def url(i: int) -> str:
        _wire, img, _msgs = request(i)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def chat(i: int) -> Any:
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(i)}},
                                             {"type": "text", "text": f"Describe picture {i}."}]}]
        return client.chat.completions.create(model="tiny-llava", messages=msgs, max_tokens=10, temperature=0)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:  # concurrent: they share iterations and decode steps
        replies = list(pool.map(chat, range(3)))
    for i, r in enumerate(replies):
        assert r.model_extra["easerve"]["token_ids"] == reference(i)
        assert r.model_extra["easerve"]["route"] == "aggregated"
        assert r.usage.completion_tokens == len(reference(i))
