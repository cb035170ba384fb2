"""`easerve serve` of a tiny-model torch spec on the CPU, answering the `openai` client.

Real processes over Dynamo (file discovery, TCP request plane), real tokenizer and chat template:
the reply's text is what the model directory's tokenizer decodes from the reply's token ids,
and the usage counts are the tokenizer's.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_process import serve_process

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

SPEC = """apiVersion: easerve.io/v1alpha1
kind: EPDDeployment
metadata: {{name: tiny-torch}}
spec:
  model: {{name: {name}, modality: image, encoder: {encoder}, path: {path}}}
  engine: {{backend: torch, profile: {profile}}}
  decode: {{kvMemoryFraction: 0.01}}
  gpuBudget: 3
  allocation: {{encode: {{replicas: 1}}, prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}
  encode: {{batchBound: 4, dispatch: eager}}
  offload: {{ratio: 0.5}}
  slo: {{objective: m, tiers: [{{name: m, ttftSeconds: 30, tpotMs: 1000}}]}}
  discovery: {{backend: file}}
"""


_WORKDIR: dict[str, Path] = {}
"""The served deployment's workdir (its processes.json names each worker's metrics port)."""


LLAVA = {"name": "tiny-llava", "encoder": "clip-vit-l-336", "profile": "llava-v1.6-34b@h200"}
QWEN = {"name": "tiny-qwen-vl", "encoder": "qwen2-vl-vision", "profile": "qwen2.5-vl-32b@h200"}


@pytest.fixture(scope="module")
def served(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve(model_dirs["llava-next"], LLAVA, tmp_path_factory)


def serve(model_dir: Path, model: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``easerve serve`` of the tiny-model spec as a subprocess; yields its OpenAI base URL."""
    tmp = tmp_path_factory.mktemp("torch-serve")
    env = {"EASERVE_DEVICE": "cpu", "EASERVE_TORCH_MAX_LEN": "1536", "OMP_NUM_THREADS": "1"}
    with serve_process(SPEC.format(path=model_dir, **model), tmp, env) as (port, wd):
        _WORKDIR["wd"] = wd
        yield f"http://127.0.0.1:{port}/v1"


def image_url() -> str:
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(3).random((48, 64, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": image_url()}},
    {"type": "text", "text": "What is in this picture?"},
]}]


def prompt_len(model_dir: Path) -> int:
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    data = base64.b64decode(MESSAGES[0]["content"][0]["image_url"]["url"].split(",", 1)[1])
    img = Image.open(io.BytesIO(data)).convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    return len(proc(images=[img], text=[proc.apply_chat_template(msgs, add_generation_prompt=True)])["input_ids"][0])


def test_openai_chat_with_an_image(served: str, model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["llava-next"])
    client = openai.OpenAI(base_url=served, api_key="none", timeout=120)
    r = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=8, temperature=0)
    ids = r.model_extra["easerve"]["token_ids"]
    assert 1 <= len(ids) <= 8
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == prompt_len(model_dirs["llava-next"])  # the tokenizer's count
    assert r.choices[0].finish_reason in ("stop", "length")

    # streaming: the same greedy tokens, detokenized incrementally, and the same usage
    stream = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, sids, usage = "", [], None
    for chunk in stream:
        extra = chunk.model_extra.get("easerve") or {}
        if "token_id" in extra:
            sids.append(extra["token_id"])
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert sids == ids
    assert text == r.choices[0].message.content
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens


def test_sampling_is_per_request_and_seeded(served: str) -> None:
    client = openai.OpenAI(base_url=served, api_key="none", timeout=120)

    def ask(seed: int) -> list[int]:
        r = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=6, temperature=1.5,
                                           top_p=0.95, seed=seed)
        return list(r.model_extra["easerve"]["token_ids"])

    assert ask(1) == ask(1)  # the same seed, the same tokens
    assert len({tuple(ask(s)) for s in range(2, 6)}) > 1


def test_ignore_eos_generates_max_tokens_past_stop_tokens(served: str) -> None:
    """The benchmark extension (vLLM's and SGLang's): the greedy answer that a stop token ends early
    continues to max_tokens, same prefix; a non-boolean is a 400 naming the field."""
    client = openai.OpenAI(base_url=served, api_key="none", timeout=120)
    greedy = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=24, temperature=0)
    ids = list(greedy.model_extra["easerve"]["token_ids"])
    r = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    long = list(r.model_extra["easerve"]["token_ids"])
    assert len(long) == 24 and r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    assert long[: len(ids)] == ids
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=4,
                                       extra_body={"ignore_eos": "yes"})


def test_a_client_that_leaves_mid_stream_frees_its_decode_slot(served: str, model_dirs: dict[str, Path]) -> None:
    """The torch engine's decode slot is freed when the client leaves: the decode worker counts the
    request as cancelled, its batch is empty, and the next request is served in full. (The whole
    ~1,400 tokens take about 3 s on this tiny model on a CPU, so the cancel, which follows the
    third token, has seconds to arrive.)"""
    import json
    import urllib.request

    procs = json.loads((_WORKDIR["wd"] / "processes.json").read_text())["processes"]
    port = next(p["system_port"] for p in procs if p["stage"] == "decode")

    def decode_metric(name: str, labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and labels in line)

    before = decode_metric("easerve_stage_requests_total", 'status="cancelled"')
    n = 1500 - prompt_len(model_dirs["llava-next"])  # EASERVE_TORCH_MAX_LEN is 1536: seconds of decode
    client = openai.OpenAI(base_url=served, api_key="none", timeout=120)
    stream = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=n, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            got += 1
            if got == 3:
                break
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and decode_metric("easerve_stage_requests_total", 'status="cancelled"') < before + 1:
        time.sleep(0.1)
    assert decode_metric("easerve_stage_requests_total", 'status="cancelled"') == before + 1, f"{n} tokens ran out"
    while time.monotonic() < deadline and decode_metric("easerve_stage_inflight", 'stage="decode"') > 0:
        time.sleep(0.1)
    assert decode_metric("easerve_stage_inflight", 'stage="decode"') == 0
    r = client.chat.completions.create(model="tiny-llava", messages=MESSAGES, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16



@pytest.fixture(scope="module")
def served_qwen(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve(model_dirs["qwen2.5-vl"], QWEN, tmp_path_factory)


def test_qwen_vl_over_openai_equals_generate(served_qwen: str, model_dirs: dict[str, Path]) -> None:
    """Qwen2.5-VL through ``easerve serve``'s real processes (encode, remote and local prefill,
    decode over Dynamo): greedy replies equal transformers' own generate, which needs the 3-D
    M-RoPE positions and their delta carried from encode through prefill to decode."""
    import torch
    import transformers
    from easerve_runtime.models.loading import load_processor
    from PIL import Image

    d = model_dirs["qwen2.5-vl"]
    proc = load_processor(d)
    model = getattr(transformers, transformers.AutoConfig.from_pretrained(d).architectures[0]).from_pretrained(d)
    data = base64.b64decode(MESSAGES[0]["content"][0]["image_url"]["url"].split(",", 1)[1])
    img = Image.open(io.BytesIO(data)).convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    inp = proc(images=[img], text=[proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)],
               return_tensors="pt")
    with torch.inference_mode():
        ref = model.eval().generate(**inp, max_new_tokens=12, do_sample=False)[0, inp["input_ids"].shape[1]:].tolist()
    ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in (model.generation_config.eos_token_id,)), len(ref))]

    client = openai.OpenAI(base_url=served_qwen, api_key="none", timeout=120)
    routes = set()
    for _ in range(4):  # offload ratio 0.5: both the remote and the local prefill route serve some
        r = client.chat.completions.create(model="tiny-qwen-vl", messages=MESSAGES, max_tokens=12, temperature=0)
        assert r.model_extra["easerve"]["token_ids"] == ref
        assert r.usage.prompt_tokens == inp["input_ids"].shape[1]
        routes.add(r.model_extra["easerve"].get("route"))
    assert routes == {"local", "remote"}, routes  # the deficit router alternates at s = 0.5
