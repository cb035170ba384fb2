"""The torch engine through the real E/P/D workers on the CPU, against transformers' own generate.

Dynamo's request plane is replaced by direct calls (as in tests/runtime/test_workers_inproc.py);
everything else is real: the tiny LLaVA-NeXT directory made by ``easerve model init``, its
processor and chat template, the encoder, the model's own merge, the KV cache packed, chunked
and copied into decode slots, and continuous batching. ``easerve serve`` over Dynamo is covered
by test_torch_serve.py.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from easerve_runtime.api import parse_spec
from easerve_runtime.engines.base import MediaPart
from easerve_runtime.metrics import Metrics
from easerve_runtime.workers.decode import DecodeWorker
from easerve_runtime.workers.encode import EncodeWorker
from easerve_runtime.workers.pool import InProcessPool, StageError
from easerve_runtime.workers.prefill import PrefillWorker
from easerve_runtime.workers.wire import part_to_wire

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


class DirectPool:
    """One instance per handler, called directly; least outstanding first."""

    def __init__(self, handlers: dict[int, Callable[..., AsyncIterator[Any]]], name: str) -> None:
        self.handlers = handlers
        self.name = name
        self.outstanding: dict[int, int] = {}

    def instances(self) -> list[int]:
        return sorted(self.handlers)

    def pick(self, exclude: set[int] | None = None, extra: dict[int, int] | None = None) -> int:
        ids = [i for i in self.instances() if not exclude or i not in exclude]
        if not ids:
            raise StageError(f"no live {self.name} instance", retryable=True)
        return min(ids, key=lambda i: self.outstanding.get(i, 0) + (extra or {}).get(i, 0))

    async def stream(self, request: Any, instance: int | None = None, weight: int = 1) -> AsyncIterator[Any]:
        iid = instance if instance is not None else self.pick()
        self.outstanding[iid] = self.outstanding.get(iid, 0) + weight
        try:
            async for item in self.handlers[iid](request):
                yield item
        finally:
            self.outstanding[iid] -= weight


def image(seed: int, h: int, w: int) -> Any:
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def request(i: int, max_tokens: int = MAX_TOKENS) -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    img = image(i, 30 + 7 * i, 60 - 5 * i)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe picture {i}."}]}]
    part = MediaPart("image", buf.getvalue(), "image/png", {"height": img.height, "width": img.width})
    wire = {"id": f"r{i}", "seed": i, "text_tokens": 1, "max_tokens": max_tokens, "priority": 0,
            "parts": [part_to_wire(part)], "messages": msgs, "temperature": 0.0, "top_p": 1.0}
    return wire, img, msgs


@pytest.fixture(scope="module")
def llava(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llava-next"]


@pytest.fixture(scope="module")
def engines(llava: Path) -> dict[str, Any]:
    from easerve_runtime.engines.hf import HFEncodeEngine, HFPrefillEngine

    return {"encode": HFEncodeEngine(llava), "prefill": HFPrefillEngine(llava)}


def full_model(path: Path) -> tuple[Any, Any]:
    """The directory's processor (the engine's loader) and its whole model class, as transformers loads them."""
    import transformers
    from easerve_runtime.models.loading import load_processor

    cfg = transformers.AutoConfig.from_pretrained(path)
    return load_processor(path), getattr(transformers, cfg.architectures[0]).from_pretrained(path).eval()


def reference_for(path: Path) -> Callable[[int], list[int]]:
    """transformers' own single-process greedy generate of the same directory, prompt and image."""
    proc, model = full_model(path)
    cache: dict[int, list[int]] = {}

    def ref(i: int) -> list[int]:
        if i not in cache:
            _, img, msgs = request(i)
            inp = proc(images=[img], text=[proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)],
                       return_tensors="pt")
            out = model.generate(**inp, max_new_tokens=MAX_TOKENS, do_sample=False)
            cache[i] = out[0, inp["input_ids"].shape[1]:].tolist()
        return cache[i]

    return ref


@pytest.fixture(scope="module")
def reference(llava: Path) -> Callable[[int], list[int]]:
    return reference_for(llava)


class EPD:
    """Encode + remote prefill + local prefill + one decode worker, in one loop."""

    def __init__(self, llava: Path, engines: dict[str, Any], ratio: float, slots: int, chunk: int = 4096,
                 stage_buffers: int | None = None, max_len: int = 256) -> None:
        from easerve_runtime.engines.hf import HFDecodeEngine

        spec = parse_spec({
            "model": {"name": "tiny-llava", "modality": "image", "encoder": "clip-vit-l-336", "path": str(llava)},
            "engine": {"backend": "torch", "profile": "llava-v1.6-34b@h200"},
            "gpuBudget": 3,
            "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
            "offload": {"ratio": ratio},
            "encode": {"batchBound": 4, "dispatch": "eager"},
            "slo": {"objective": "m", "tiers": [{"name": "m", "ttftSeconds": 8, "tpotMs": 100}]},
        })
        m = Metrics()
        self.metrics = m
        self.decode_engine = HFDecodeEngine(llava, max_slots=slots, max_len=max_len, stage_buffers=stage_buffers)
        self.refused = 0
        admit = self.decode_engine.can_admit

        def counting(seq: Any) -> bool:
            ok = admit(seq)
            self.refused += not ok
            return ok

        self.decode_engine.can_admit = counting  # type: ignore[method-assign]
        self.max_batch = 0
        step = self.decode_engine.decode_step

        self.max_waiting = 0

        async def recording(batch: Any) -> list[int]:
            self.max_batch = max(self.max_batch, len(batch))
            # sequences held back by the shared admission policy while every slot was taken
            self.max_waiting = max(self.max_waiting, self.decode.admission.waiting)
            return await step(batch)

        self.decode_engine.decode_step = recording  # type: ignore[method-assign]
        self.decode = DecodeWorker(self.decode_engine, m)
        dpool = DirectPool({7: self.decode.generate}, "decode")
        self.remote = PrefillWorker(engines["prefill"], m, dpool)
        self.local = PrefillWorker(engines["prefill"], m, dpool, stage="local-prefill")
        for w in (self.remote, self.local):
            w.kv_chunk_bytes = chunk  # many chunks per request: the reassembly is exercised
        self.encode = EncodeWorker(spec, engines["encode"], m, DirectPool({1: self.remote.generate}, "prefill"),
                                   InProcessPool(self.local))  # as the encode process hosts it
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> EPD:
        self.tasks = [asyncio.create_task(w.run()) for w in (self.encode, self.remote, self.local, self.decode)]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def ask(self, wire: dict[str, Any], on_token: Callable[[int], Any] | None = None) -> dict[str, Any]:
        tokens: list[int] = []
        async for item in self.encode.generate(wire):
            assert "error" not in item, item
            if "token" in item:
                tokens.append(int(item["token"]))
                if on_token is not None:
                    on_token(len(tokens))
            elif item.get("done"):
                return {"tokens": tokens, **item}
        raise AssertionError("stream ended without done")


@pytest.mark.parametrize("ratio,route", [(1.0, "remote"), (0.0, "local")])
def test_greedy_through_epd_equals_generate(llava: Path, engines: dict[str, Any], reference: Any,
                                            ratio: float, route: str) -> None:
    async def main() -> list[dict[str, Any]]:
        async with EPD(llava, engines, ratio, slots=4) as epd:
            outs = [await epd.ask(request(i)[0]) for i in (0, 1)]
            assert epd.metrics.kv_handoff_bytes._value.get() > 0  # the KV bytes really moved
            return outs

    for i, out in enumerate(asyncio.run(main())):
        assert out["route"] == route
        assert out["tokens"] == reference(i), f"request {i}: engine {out['tokens']} != generate {reference(i)}"
        n_prompt = len(engines["encode"].processor(
            images=[request(i)[1]], text=[engines["encode"].processor.apply_chat_template(
                request(i)[2], add_generation_prompt=True)])["input_ids"][0])
        assert out["prompt_tokens"] == n_prompt  # the tokenizer's count, placeholders included


def test_requests_joining_mid_decode_keep_their_solo_outputs(llava: Path, engines: dict[str, Any],
                                                              reference: Any) -> None:
    async def main() -> dict[int, list[int]]:
        async with EPD(llava, engines, 0.5, slots=4) as epd:
            joined = asyncio.Event()
            first = asyncio.create_task(epd.ask(request(2)[0], lambda n: n >= 3 and joined.set()))
            await joined.wait()  # request 2 is decoding: 3 and 4 join its running batch
            rest = await asyncio.gather(epd.ask(request(3)[0]), epd.ask(request(4)[0]))
            outs = [await first, *rest]
            assert epd.max_batch >= 2  # they really shared decode steps
            return {i: o["tokens"] for i, o in zip((2, 3, 4), outs, strict=True)}

    outs = asyncio.run(main())
    assert len({tuple(t) for t in outs.values()}) > 1  # distinct prompts, distinct outputs
    for i, toks in outs.items():
        assert toks == reference(i), f"request {i} changed when batched"


def test_more_requests_than_kv_slots_wait_and_all_complete(llava: Path, engines: dict[str, Any],
                                                           reference: Any) -> None:
    async def main() -> tuple[list[dict[str, Any]], EPD]:
        async with EPD(llava, engines, 0.5, slots=2) as epd:
            outs = await asyncio.gather(*(epd.ask(request(i)[0]) for i in range(5)))
            return list(outs), epd

    outs, epd = asyncio.run(main())
    assert epd.decode_engine.slots == 2
    assert epd.max_waiting > 0 and epd.max_batch <= 2  # some requests did wait for a slot
    assert epd.refused == 0  # admission counts slots, so the engine is never asked beyond them
    assert not epd.decode_engine.slot_of  # every slot was released
    for i, out in enumerate(outs):
        assert out["tokens"] == reference(i)


class OffersAShare:
    """The real prefill engine, whose outputs also offer a same-GPU share (``engines.kv_ipc``) that a
    decode on the CPU cannot map; records each answer the worker passes back."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.answers: list[tuple[bool, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def prefill(self, batch: Any, sm_share: float = 1.0) -> Any:
        import dataclasses

        def share() -> tuple[dict[str, Any], Callable[[bool, bool], None]]:
            return {"gpu": "GPU-elsewhere", "handle": None}, lambda taken, mapped=False: self.answers.append(
                (taken, mapped))

        outs = await self.inner.prefill(batch, sm_share)
        return [dataclasses.replace(o, share_kv=share) for o in outs]


def test_a_refused_same_gpu_share_falls_back_to_host_bytes_and_loses_nothing(llava: Path, engines: dict[str, Any],
                                                                           reference: Any) -> None:
    """Decode refuses a share it cannot map before anything else; the prefill worker then sends
    that instance the host copy (chunks here) and offers it no share again. Outputs equal generate."""
    sharing = OffersAShare(engines["prefill"])

    async def main() -> tuple[list[dict[str, Any]], EPD]:
        async with EPD(llava, {**engines, "prefill": sharing}, 1.0, slots=4) as epd:
            return [await epd.ask(request(i)[0]) for i in (0, 1)], epd

    outs, epd = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out["tokens"] == reference(i)
    assert sharing.answers == [(False, False)]  # refused once, never mapped; the second was not offered one
    assert epd.remote._ipc_refused == {7} and epd.remote._ipc_outstanding == 0
    assert epd.decode_engine.stats["ipc_opened"] == 0
    assert epd.decode_engine.stats["admits"] == 2


@pytest.mark.parametrize("stage_buffers", [0, 2], ids=["at-admission", "at-staging"])
def test_a_share_that_passes_the_check_but_fails_to_open_falls_back_to_host_bytes(
        llava: Path, engines: dict[str, Any], reference: Any, stage_buffers: int) -> None:
    """Decode accepts the share (its check passes) but cannot open it later, when it stages the
    cache or, with no staging buffer, at admission: the refusal still reaches the prefill worker
    before any token, the host copy follows, and nothing is lost. (On the CPU the open fails
    before anything is mapped, so the producer returns the IPC count itself.)"""
    sharing = OffersAShare(engines["prefill"])

    async def main() -> tuple[list[dict[str, Any]], EPD]:
        epd = EPD(llava, {**engines, "prefill": sharing}, 1.0, slots=4, stage_buffers=stage_buffers)
        epd.decode_engine.check_kv_share = lambda desc: None  # type: ignore[method-assign]
        async with epd:
            return [await epd.ask(request(i)[0]) for i in (0, 1)], epd

    outs, epd = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out["tokens"] == reference(i)
    assert sharing.answers == [(False, False)]
    assert epd.remote._ipc_refused == {7} and epd.remote._ipc_outstanding == 0
    assert epd.decode_engine.stats["ipc_opened"] == 0 and epd.decode_engine.stats["admits"] == 2


@pytest.mark.parametrize("stage_buffers", [0, 1])
def test_kv_staging_with_fewer_buffers_than_waiting_caches(llava: Path, engines: dict[str, Any], reference: Any,
                                                          stage_buffers: int, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches that find no free staging buffer wait on the host and are staged (or loaded at
    admission) later; every output still equals generate, every buffer comes back, and the decode
    loop's statistics file counts what happened."""
    import json

    monkeypatch.setenv("EASERVE_DECODE_STATS", str(tmp_path))

    async def main() -> tuple[list[dict[str, Any]], EPD]:
        async with EPD(llava, engines, 0.5, slots=2, stage_buffers=stage_buffers) as epd:
            outs = await asyncio.gather(*(epd.ask(request(i)[0]) for i in range(5)))
            await asyncio.sleep(0.05)  # the loop goes idle and writes its statistics
            return list(outs), epd

    outs, epd = asyncio.run(main())
    eng = epd.decode_engine
    assert eng.stage_buffers == stage_buffers
    for i, out in enumerate(outs):
        assert out["tokens"] == reference(i)
    assert len(eng._stage_free) == stage_buffers and not eng._staged  # every buffer came back
    st = eng.stats
    assert st["admits"] == 5 and st["staged"] + st["admit_unstaged"] == 5
    if stage_buffers == 0:
        assert st["staged"] == 0
    else:
        assert st["staged"] >= 1  # with 2 slots and 5 requests at once, some waited on the host
    assert st["steps"] > 0 and st["rows"] >= st["steps"]
    (stats_file,) = tmp_path.glob("decode-*.json")
    doc = json.loads(stats_file.read_text())
    assert doc["engine"]["admits"] == 5 and doc["loop"]["admitted"] == 5 and doc["loop"]["iterations"] > 0
    # the handoff (reaching the worker to joining its batch) is counted for every admitted request,
    # and those that waited for one of the 2 slots waited at least a decode step each
    assert doc["loop"]["handoff_s"] > 0 and not epd.decode._entered


def test_a_llava_next_batch_counts_its_crops_as_the_profile_and_the_twin_do(engines: dict[str, Any]) -> None:
    """``batch_items`` (what the encode worker looks its profile and SM share up by) counts anyres
    crops from each part's header descriptor, as the engine profile's points and the twin's requests
    do (``workload.media.items_tokens``), not images; a part without a descriptor counts 1, a
    text-only request 0."""
    from easerve_runtime.engines.base import EncodeInput
    from easerve_runtime.workload.media import items_tokens

    enc = engines["encode"]
    assert enc.family == "llava_next"
    png = request(0)[0]
    sizes = [(30, 60), (672, 672), (336, 1008)]
    parts = [MediaPart("image", b"", "image/png", {"height": h, "width": w}) for h, w in sizes]
    batch = [EncodeInput("a", (parts[0],), 0, ()), EncodeInput("b", (parts[1], parts[2]), 1, ()),
             EncodeInput("c", (MediaPart("image", b"", "image/png", {}),), 2, ()), EncodeInput("t", (), 3, ())]
    crops = [items_tokens("image", {"height": h, "width": w}, True)[0] for h, w in sizes]
    assert crops == [3, 5, 4]
    assert enc.batch_items(batch) == sum(crops) + 1 > len(sizes) + 1
    from easerve_runtime.workers.wire import part_from_wire

    served = part_from_wire(png["parts"][0])  # a request as the frontend hands it on: the descriptor travels
    assert enc.batch_items([EncodeInput("r0", (served,), 0, ())]) == items_tokens("image", dict(served.media), True)[0]


def test_chunked_encode_equals_one_pass(engines: dict[str, Any]) -> None:
    """The pipelined encode (chunks of 1 image, processor on the helper thread) gives the same
    token ids and embedding rows as one processor call and one tower pass over the batch."""
    from easerve_runtime.engines.base import EncodeInput
    from easerve_runtime.workers.wire import part_from_wire

    enc = engines["encode"]
    batch = []
    for i in range(4):
        wire = request(i)[0]
        batch.append(EncodeInput(wire["id"], tuple(part_from_wire(p) for p in wire["parts"]), i,
                                 tuple(wire["messages"])))
    batch.append(EncodeInput("text-only", (), 9, ({"role": "user", "content": [{"type": "text", "text": "hi"}]},)))
    old, old_ramp = enc.chunk_images, enc.chunk_ramp
    try:
        enc.chunk_images = 0
        one = enc._encode_sync(batch)
        enc.chunk_images = 1
        assert [len(c) for c in enc._chunks(batch)] == [1, 1, 1, 2]  # the text-only request joins the last
        chunked = enc._encode_sync(batch)
        enc.chunk_images, enc.chunk_ramp = 4, True  # the ramp: a short first chunk, then up to 4; a small remainder joins the last
        sixteen = batch[:1] * 16
        assert [len(c) for c in enc._chunks(sixteen)] == [1, 2, 4, 4, 5]
        enc.chunk_ramp = False
        assert [len(c) for c in enc._chunks(sixteen)] == [4, 4, 4, 4]
    finally:
        enc.chunk_images, enc.chunk_ramp = old, old_ramp
    assert [e.request_id for e in chunked] == [r.request_id for r in batch]
    for a, b in zip(one, chunked, strict=True):
        assert a.extra == b.extra and a.shape == b.shape and a.dtype == b.dtype
        x = np.frombuffer(a.data, dtype=np.float32) if a.dtype == "float32" else np.frombuffer(a.data, np.uint16)
        y = np.frombuffer(b.data, dtype=x.dtype)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_graph_captures_warm_up_leaves_running_rows_caches_alone(llava: Path) -> None:
    """A CUDA graph's warm-up and capture steps really run over slots 0..b-1, where sequences are
    running, with the static inputs ``capture_inputs`` gives. Those must write only where no
    running row has attended yet, or every capture mid-serving corrupts the running caches (the
    static position used to be 0: each running sequence's first cached token). Checked on the
    CPU by running the step a capture runs; the GPU test replays real graphs."""
    import torch
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    eng = HFDecodeEngine(llava, max_slots=4, max_len=256, stage_buffers=0, cuda_graphs=False)
    torch.manual_seed(0)
    with torch.inference_mode():
        eng.K.normal_()
        eng.V.normal_()
    lengths = [5, 140, 77]  # the rows' next positions; they have attended 0..length-1
    kv_len = hf.kv_bucket(max(lengths) + 1, eng.max_len)
    before = [(eng.K[:, r, :, :n].clone(), eng.V[:, r, :, :n].clone()) for r, n in enumerate(lengths)]
    st = eng.capture_inputs(4, kv_len)
    with torch.inference_mode():
        eng._forward(st["ids"], st["pos"], 4, kv_len)
    for r, n in enumerate(lengths):
        assert torch.equal(eng.K[:, r, :, :n], before[r][0]) and torch.equal(eng.V[:, r, :, :n], before[r][1]), r
    assert int(st["pos"].min()) >= max(lengths)


# -- Qwen2.5-VL: M-RoPE positions carried through the handoff ------------------------------------
@pytest.fixture(scope="module")
def qwen(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["qwen2.5-vl"]


@pytest.fixture(scope="module")
def qwen_engines(qwen: Path) -> dict[str, Any]:
    from easerve_runtime.engines.hf import HFEncodeEngine, HFPrefillEngine

    return {"encode": HFEncodeEngine(qwen), "prefill": HFPrefillEngine(qwen)}


@pytest.mark.parametrize("ratio,route", [(1.0, "remote"), (0.0, "local")])
def test_qwen_vl_greedy_through_epd_equals_generate(qwen: Path, qwen_engines: dict[str, Any], ratio: float,
                                                    route: str) -> None:
    """Qwen2.5-VL's 3-D positions: encode sends the images' grids, prefill takes the positions
    and the delta from the model's get_rope_index, decode rotates by slot position + delta."""
    ref = reference_for(qwen)

    async def main() -> list[dict[str, Any]]:
        async with EPD(qwen, qwen_engines, ratio, slots=4) as epd:
            return list(await asyncio.gather(*(epd.ask(request(i)[0]) for i in (0, 1, 2))))

    for i, out in enumerate(asyncio.run(main())):
        assert out["route"] == route
        assert out["tokens"] == ref(i), f"request {i}: engine {out['tokens']} != generate {ref(i)}"


def decode_logits_against_whole(qwen: Path, engines: dict[str, Any], wire: dict[str, Any],
                                ref: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """One request through encode, prefill (its KV cache handed over) and one decode step; returns
    that step's logits with the rotary delta, without it, the whole model's logits over prompt +
    first token (processor inputs ``ref``), and what encode sent."""
    import torch
    from easerve_runtime.engines.base import DecodeSequence, EncodeInput, PrefillInput, Sampling
    from easerve_runtime.engines.hf import HFDecodeEngine
    from easerve_runtime.workers.wire import part_from_wire

    msgs = wire["messages"]
    emb = engines["encode"]._encode_sync(
        [EncodeInput(wire["id"], tuple(part_from_wire(p) for p in wire["parts"]), 3, tuple(msgs))])[0]
    rows = np.frombuffer(bytes(emb.data), dtype=np.float32).reshape(emb.shape)
    out = engines["prefill"].prefill_one(
        PrefillInput(wire["id"], 1, emb.tokens, embedding=rows, extra=dict(emb.extra), sampling=Sampling(0.0)))
    delta = out.kv_meta["rope_delta"]
    n = len(emb.extra["input_ids"])
    dec = HFDecodeEngine(qwen, max_slots=1, max_len=1024)
    asyncio.run(dec.admit(DecodeSequence(wire["id"], n, 4, generated=[out.first_token], kv=out.kv,
                                         kv_meta=out.kv_meta)))
    assert dec.rope_delta[wire["id"]] == delta
    ids, pos = torch.tensor([out.first_token]), torch.tensor([n])
    with torch.inference_mode():
        ours = dec._forward(ids, pos, 1, 1024, pos + delta)[0]
        without = dec._forward(ids, pos, 1, 1024, pos)[0]

    proc, model = full_model(qwen)
    inp = proc(text=[proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)], return_tensors="pt",
               **ref)
    assert inp["input_ids"][0].tolist() == emb.extra["input_ids"]
    inp["input_ids"] = torch.cat([inp["input_ids"], ids[None]], 1)
    inp["attention_mask"] = torch.ones_like(inp["input_ids"])
    inp["mm_token_type_ids"] = torch.cat([inp["mm_token_type_ids"], torch.zeros_like(inp["mm_token_type_ids"][:, :1])], 1)
    with torch.inference_mode():
        whole = model(**inp).logits[0, -1]
    return ours, without, whole, dict(emb.extra) | {"rope_delta": delta}


def test_qwen_vl_decode_logits_equal_the_whole_model_and_need_the_delta(qwen: Path,
                                                                        qwen_engines: dict[str, Any]) -> None:
    """Greedy tokens of a tiny random model are too coarse to show a wrong rotary offset, so this
    compares logits: the decode step after the handed-over cache equals the whole model's
    forward over prompt + first token, and the same step without the delta does not."""
    wire, img, _ = request(3)
    ours, without, whole, sent = decode_logits_against_whole(qwen, qwen_engines, wire, {"images": [img]})
    assert sent["image_grid_thw"] and sent["image_grid_thw"][0][0] == 1
    assert sent["rope_delta"] < 0  # an image's rows span fewer positions than tokens
    assert torch_allclose(ours, whole)
    assert (without - whole).abs().max() > 100 * (ours - whole).abs().max().clamp_min(1e-7)


def torch_allclose(a: Any, b: Any) -> bool:
    import torch

    ok = bool(torch.allclose(a, b, atol=1e-5))
    assert ok, (a - b).abs().max()
    return ok


def test_qwen_vl_refuses_a_container_video_with_a_message(qwen_engines: dict[str, Any]) -> None:
    from easerve_runtime.engines.base import EncodeInput

    part = MediaPart("video", b"\x00\x00\x00\x18ftypmp42", "video/mp4", {"frames": 8})
    with pytest.raises(ValueError, match="request v1: a video/mp4 video is not decoded .* send the video as its frames"):
        qwen_engines["encode"]._encode_sync([EncodeInput("v1", (part,), 0, ())])


# -- Qwen2.5-VL video, sent as frames ------------------------------------------------------------
FRAMES = 4


def test_without_torchvision_a_video_is_refused_naming_it(qwen_engines: dict[str, Any]) -> None:
    """transformers builds Qwen2-VL's video processor only with torchvision: without it (this CPU
    CI) a frame-list video is refused with a message that says so, and images still serve."""
    import importlib.util

    from easerve_runtime.engines.base import EncodeInput

    if importlib.util.find_spec("torchvision") is not None and qwen_engines["encode"].processor.video_processor:
        pytest.skip("torchvision is installed here: the video tests below run instead")
    _, part = video(1)
    with pytest.raises(ValueError, match="request v2: videos need the model's video processor.*torchvision"):
        qwen_engines["encode"]._encode_sync([EncodeInput("v2", (part,), 0, ())])


def video(seed: int) -> tuple[Any, MediaPart]:
    """A short clip of ``FRAMES`` random frames: the ``[T, 3, H, W]`` uint8 tensor the reference
    hands the processor, and the frame-list part (PNG frames, lossless) the frontend would make."""
    import torch
    from easerve_runtime.engines.base import FRAME_LIST_MIME

    frames = [image(100 * seed + k, 56, 84) for k in range(FRAMES)]
    datas = []
    for f in frames:
        buf = io.BytesIO()
        f.save(buf, format="PNG")
        datas.append(buf.getvalue())
    tensor = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).contiguous()
    media = {"frames": FRAMES, "height": 56, "width": 84, "fps": 1.0, "frame_bytes": [len(d) for d in datas]}
    return tensor, MediaPart("video", b"".join(datas), FRAME_LIST_MIME, media)


def video_request(i: int, with_image: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A video (and, with ``with_image``, an image after it: the rows travel images first) and the
    processor inputs of the same prompt for the reference."""
    clip, part = video(i)
    content: list[dict[str, Any]] = [{"type": "video"}]
    parts = [part]
    ref: dict[str, Any] = {"videos": [clip], "video_metadata": [{"fps": 1.0, "total_num_frames": FRAMES}],
                           "do_sample_frames": False}
    if with_image:
        _, img, _ = request(i)
        content.append({"type": "image"})
        parts.append(MediaPart("image", part_img_bytes(img), "image/png", {"height": img.height, "width": img.width}))
        ref["images"] = [img]
    content.append({"type": "text", "text": f"What happens in clip {i}?"})
    msgs = [{"role": "user", "content": content}]
    wire = {"id": f"v{i}", "seed": i, "text_tokens": 1, "max_tokens": MAX_TOKENS, "priority": 0,
            "parts": [part_to_wire(p) for p in parts], "messages": msgs, "temperature": 0.0, "top_p": 1.0}
    return wire, {**ref, "messages": msgs}


def part_img_bytes(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("ratio,route", [(1.0, "remote"), (0.0, "local")])
def test_qwen_vl_video_greedy_through_epd_equals_generate(qwen: Path, qwen_engines: dict[str, Any], ratio: float,
                                                          route: str) -> None:
    """A video sent as frames, alone and beside an image: encode runs the library's video
    processor and the tower's video path, prefill scatters the rows by the model's own image and
    video masks and takes the 3-D positions (the videos' grids and seconds per grid) from
    ``get_rope_index``; the greedy output equals generate's."""
    pytest.importorskip("torchvision", reason="transformers' Qwen2-VL video processor needs torchvision")
    proc, model = full_model(qwen)

    def reference(i: int, with_image: bool) -> list[int]:
        _, ref = video_request(i, with_image)
        msgs = ref.pop("messages")
        inp = proc(text=[proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)],
                   return_tensors="pt", **ref)
        out = model.generate(**inp, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, inp["input_ids"].shape[1]:].tolist()

    cases = [(5, False), (6, True)]

    async def main() -> list[dict[str, Any]]:
        async with EPD(qwen, qwen_engines, ratio, slots=4, max_len=1024) as epd:  # a clip is ~300 tokens
            return list(await asyncio.gather(*(epd.ask(video_request(i, w)[0]) for i, w in cases)))

    for (i, with_image), out in zip(cases, asyncio.run(main()), strict=True):
        assert out["route"] == route
        want = reference(i, with_image)
        assert out["tokens"] == want, f"clip {i}: engine {out['tokens']} != generate {want}"


def test_qwen_vl_video_rows_and_grids_travel_to_prefill(qwen: Path, qwen_engines: dict[str, Any]) -> None:
    """What encode sends for a video beside an image: the images' rows first (``image_rows``), the
    video's grid (``FRAMES`` frames in temporal pairs) and its seconds per grid (2 frames at 1 fps)."""
    pytest.importorskip("torchvision", reason="transformers' Qwen2-VL video processor needs torchvision")
    from easerve_runtime.engines.base import EncodeInput
    from easerve_runtime.workers.wire import part_from_wire

    wire, _ = video_request(7, with_image=True)
    emb = qwen_engines["encode"]._encode_sync(
        [EncodeInput(wire["id"], tuple(part_from_wire(p) for p in wire["parts"]), 1, tuple(wire["messages"]))])[0]
    (t, h, w), = emb.extra["video_grid_thw"]
    assert t == FRAMES // 2 and emb.extra["second_per_grid_ts"] == [2.0]
    (ti, hi, wi), = emb.extra["image_grid_thw"]
    merge = 4  # spatial_merge_size ** 2
    assert emb.extra["image_rows"] == ti * hi * wi // merge
    assert emb.shape[0] == emb.extra["image_rows"] + t * h * w // merge


def test_qwen_vl_video_decode_logits_equal_the_whole_model(qwen: Path, qwen_engines: dict[str, Any]) -> None:
    """The video's 3-D positions at logit level (greedy tokens cannot see them): with the clip's
    seconds per grid (2 s: 2 frames at 1 fps) the decode step after the handoff equals the whole
    model's forward; prefill's positions without them, or without the delta, do not."""
    pytest.importorskip("torchvision", reason="transformers' Qwen2-VL video processor needs torchvision")
    wire, ref = video_request(8, with_image=True)
    ref.pop("messages")
    ours, without, whole, sent = decode_logits_against_whole(qwen, qwen_engines, wire, ref)
    assert sent["second_per_grid_ts"] == [2.0] and sent["rope_delta"] < 0
    assert torch_allclose(ours, whole)
    assert (without - whole).abs().max() > 100 * (ours - whole).abs().max().clamp_min(1e-7)
    # the same request with the seconds per grid lost on the way: prefill's positions differ
    lost = dict(wire)
    ours_lost, _, whole_again, _ = decode_logits_against_whole(
        qwen, {**qwen_engines, "prefill": _DropSeconds(qwen_engines["prefill"])}, lost, ref)
    assert (ours_lost - whole_again).abs().max() > 100 * (ours - whole).abs().max().clamp_min(1e-7)


class _DropSeconds:
    """A prefill engine that loses ``second_per_grid_ts`` from what encode sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prefill_one(self, r: Any) -> Any:
        import dataclasses

        extra = {k: v for k, v in r.extra.items() if k != "second_per_grid_ts"}
        return self.inner.prefill_one(dataclasses.replace(r, extra=extra))



def test_the_encoder_preprocesses_where_the_spec_says(llava: Path) -> None:
    """``spec.encode.preprocessing`` reaches the engine ``make_torch_engine`` builds (GPU unless the
    spec says cpu), and a value it does not know is refused naming the field."""
    from easerve_runtime.engines.torch import make_torch_engine

    def spec(pre: str | None) -> Any:
        doc: dict[str, Any] = {
            "model": {"name": "tiny-llava", "modality": "image", "encoder": "clip-vit-l-336", "path": str(llava)},
            "engine": {"backend": "torch", "profile": "llava-v1.6-34b@h200"}, "gpuBudget": 2,
            "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 0}, "decode": {"replicas": 1}},
            "slo": {"objective": "m", "tiers": [{"name": "m", "ttftSeconds": 8, "tpotMs": 100}]},
        }
        if pre is not None:
            doc["encode"] = {"preprocessing": pre}
        return parse_spec(doc)

    assert {pre: make_torch_engine(spec(pre), "encode").gpu_decode for pre in (None, "gpu", "cpu")} == {
        None: True, "gpu": True, "cpu": False}
    with pytest.raises(ValueError, match="preprocessing"):
        spec("auto")
