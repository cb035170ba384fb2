"""The torch engine on one GPU: encode, prefill, decode, KV handoff and the SM split, side by side.

Runs ON the GPU machine (H200), with random weights from `easerve model init --size 7b` configs
(a LLaVA-NeXT 7B: CLIP ViT-L/336 + Mistral-7B backbone), and writes to ``--out``:
``gpu_engine.json`` (rewritten after every section, so a run cut short keeps what it measured)
and ``gpu_engine.png``. Sections (``--only`` / ``--skip`` pick):

- ``encode``: images/s for (a) the per-request pass-through (PIL decode + processor on the CPU +
  batch 1) and (b) our micro-batch, nvJPEG + processor on CUDA, at B = 8 and 16; 720p and 1080p
  JPEGs. Anchors: pass-through 27-47 img/s, all-GPU ~190 img/s at 1080p; goal >= 180 at 1080p.
- ``prefill``: 2048 tokens, language-model forward + first token (and the KV pack for the
  handoff, timed apart). Reference: 58.6 ms (HF + SDPA, bf16). Goal within 1.2x.
- ``decode``: one step at batch 1, 32, 128 with context 2048, CUDA-graph and eager. Reference:
  6.95 ms at b1, 9.66 ms at b32, 16.0 ms at b128. Goal within 1.2x.
- ``handoff``: KV bytes of a 2048-token request from one process to another on this host, with
  the request plane's framing (base64 in JSON, 4 MiB chunks, 4 in flight) over loopback TCP,
  into a decode slot on the GPU: GB/s and its share of TTFT (prefill + handoff).
- ``split``: the encoder (B = 8 1080p) and a local prefill (2048 tokens) in ONE process, on plain
  streams vs on green-context streams (the encoder's share from the partition ladder): encode
  p50/p99 and prefill throughput.

    python3 -m pip install --no-index --find-links .devwheels pydantic   # if the image lacks it
    PYTHONPATH=runtime python3 benchmarks/gpu_engine.py --out $OUT        # ~6-8 min on an H200
    PYTHONPATH=runtime python3 benchmarks/gpu_engine.py --quick --out $OUT   # smoke, ~3 min
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

REF = {"prefill_2048_ms": 58.6, "decode_ms": {1: 6.95, 32: 9.66, 128: 16.0}}
SIZES = {"720p": (720, 1280), "1080p": (1080, 1920)}
DEVICE = "cuda"
"""``--smoke``: ``cpu`` with a tiny model, to run every code path here before GPU time is spent."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def jpeg(h: int, w: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients + texture), ~300-700 KB at 720p-1080p like the anchors."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([np.sin(x / (37 + seed)) * 60, np.cos(y / 53) * 60, np.sin((x + y) / 91) * 60], -1) + 128
    img = np.clip(base + rng.normal(0, 10, (h, w, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


class Results:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"env": {}, "sections": {}}

    def put(self, section: str, value: Any) -> None:
        self.data["sections"][section] = value
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_engine.json").write_text(json.dumps(self.data, indent=1, default=str))


def model_dir(out: Path) -> Path:
    """The 7B config directory, outside ``--out`` (only the JSON and the plot belong there)."""
    from easerve_runtime.models.init import init_model

    del out
    size = "tiny" if DEVICE == "cpu" else "7b"
    d = Path(os.environ.get("EASERVE_MODEL_CACHE", "/tmp/easerve-models")) / f"llava-next-{size}"
    if not (d / "config.json").exists():
        init_model("llava-next", d, size=size, weights=size == "tiny")
    return d


def empty_cache() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- encode
def _encode_rate(eng: Any, reqs: list[Any], b: int) -> tuple[float, float]:
    """Back-to-back micro-batches of ``b`` (as a loaded encode worker runs them): images/s, p50 ms."""
    for _ in range(2):
        eng._encode_sync(reqs[:b])
    sync()
    lat = []
    n = len(reqs)
    t0 = time.perf_counter()
    for i in range(0, n - b + 1, b):
        t1 = time.perf_counter()
        eng._encode_sync(reqs[i : i + b])
        sync()
        lat.append(time.perf_counter() - t1)
    done = (n // b) * b
    return round(done / (time.perf_counter() - t0), 1), round(1e3 * statistics.median(lat), 2)


def _tower_layers(eng: Any) -> int | None:
    """The encode stage's vision tower depth (it stops at the feature layer: ``truncate_to_feature_layer``)."""
    tower = getattr(eng.model.model, "vision_tower", None)
    layers = getattr(getattr(tower, "encoder", None), "layers", None)
    return len(layers) if layers is not None else None


def bench_encode(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    from easerve_runtime.engines.base import EncodeInput, MediaPart
    from easerve_runtime.engines.hf import HFEncodeEngine

    eng = HFEncodeEngine(d, device=DEVICE, random_weights=True)
    default_chunk, default_ramp = eng.chunk_images, eng.chunk_ramp
    res: dict[str, Any] = {"note": "images/s per GPU; every request one image + a short prompt; microbatch_b*: "
                           "the engine's default chunking (chunk_images), chunk_sweep: other chunk sizes "
                           "(0 = one serial pass, as before)",
                           "batched_preprocess": eng.batched_preprocess, "chunk_images": default_chunk,
                           "chunk_ramp": default_ramp, "fused_activations": eng.fused_activations,
                           "tower_layers": _tower_layers(eng)}
    msgs = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},)
    n = 8 if args.smoke else 32 if args.quick else 96
    for name, (h, w) in SIZES.items():
        if args.smoke:
            h, w = h // 8, w // 8
        imgs = [jpeg(h, w, i) for i in range(8)]
        res[f"{name}_jpeg_kb"] = round(statistics.mean(len(b) for b in imgs) / 1024)
        reqs = [EncodeInput(f"r{i}", (MediaPart("image", imgs[i % 8], "image/jpeg", {}),), 0, msgs) for i in range(n)]
        row: dict[str, Any] = {}
        # (a) pass-through: PIL + processor on the CPU, one request per encoder call
        eng.gpu_decode = False
        eng.chunk_images = 0
        for r in reqs[:3]:
            eng._encode_sync([r])
        sync()
        t0 = time.perf_counter()
        for r in reqs:
            eng._encode_sync([r])
        sync()
        row["passthrough_b1_img_s"] = round(n / (time.perf_counter() - t0), 1)
        row["passthrough_path"] = eng.last_path
        eng.profile = True
        eng._encode_sync([reqs[0]])
        eng.profile = False
        row["passthrough_phases_ms"] = dict(eng.last_timing)
        # (b) micro-batches, GPU decode + processor on CUDA, pipelined in chunks (the engine's default)
        eng.gpu_decode = True
        sweep: dict[str, Any] = {}
        for b in (8, 16):
            if b > n:
                continue
            eng.chunk_images = default_chunk
            row[f"microbatch_b{b}_img_s"], row[f"microbatch_b{b}_ms_p50"] = _encode_rate(eng, reqs, b)
            row[f"microbatch_b{b}_path"] = eng.last_path
            for c in (0, 2, 4, 8):
                for ramp in (True, False):
                    if (c == default_chunk and ramp == default_ramp) or c >= b or (c == 0 and not ramp):
                        continue
                    eng.chunk_images, eng.chunk_ramp = c, ramp
                    img_s, ms = _encode_rate(eng, reqs, b)
                    sweep[f"b{b}_chunk{c}{'' if ramp or c == 0 else '_uniform'}"] = {
                        "img_s": img_s, "ms_p50": ms, "chunks": [len(x) for x in eng._chunks(reqs[:b])]}
            eng.chunk_images, eng.chunk_ramp = default_chunk, default_ramp
            eng.profile = True  # one more batch, serial and synchronized between phases: where the time goes
            eng._encode_sync(reqs[:b])
            eng.profile = False
            row[f"microbatch_b{b}_phases_ms"] = dict(eng.last_timing)
        row["chunk_sweep"] = sweep
        if eng.fused_activations and not args.smoke:  # the same batches with the library's activation
            from easerve_runtime.engines.quick_gelu import fuse_quick_gelu

            fuse_quick_gelu(eng.model, fused=False)
            for b in (8, 16):
                if b <= n:
                    row[f"microbatch_b{b}_library_act_img_s"], _ = _encode_rate(eng, reqs, b)
            fuse_quick_gelu(eng.model)
        if "microbatch_b16_img_s" in row:
            row["speedup_b16_vs_passthrough"] = round(row["microbatch_b16_img_s"] / row["passthrough_b1_img_s"], 2)
        res[name] = row
        log(f"encode {name}: {row}")
    if args.profile and DEVICE.startswith("cuda"):
        res["profile_b16_1080p"] = _profile_encode(eng, d)
    del eng
    empty_cache()
    return res


def _profile_encode(eng: Any, d: Path) -> dict[str, Any]:
    """torch.profiler over two pipelined B = 16 1080p micro-batches: the top ops by host and by GPU time."""
    import torch
    from easerve_runtime.engines.base import EncodeInput, MediaPart

    msgs = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},)
    imgs = [jpeg(*SIZES["1080p"], i) for i in range(16)]
    reqs = [EncodeInput(f"p{i}", (MediaPart("image", imgs[i], "image/jpeg", {}),), 0, msgs) for i in range(16)]
    eng._encode_sync(reqs)
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            eng._encode_sync(reqs)
        sync()
    ka = prof.key_averages()
    return {"by_cpu": ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60),
            "by_cuda": ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)}


# ---------------------------------------------------------------------------------- prefill
def bench_prefill(args: argparse.Namespace, d: Path) -> tuple[dict[str, Any], Any]:
    import torch
    from easerve_runtime.engines.base import PrefillInput, Sampling
    from easerve_runtime.engines.hf import HFPrefillEngine, pack_kv
    from transformers import DynamicCache

    eng = HFPrefillEngine(d, device=DEVICE, random_weights=True)
    ids = list(range(100, 100 + 2048))
    r = PrefillInput("p", 2048, 0, 0, None, {"input_ids": ids}, Sampling(0.0))
    x = torch.tensor([ids], device=DEVICE)
    lm = eng.model.model.language_model
    fwd, packs = [], []
    reps = 5 if args.quick else 15
    with torch.inference_mode():
        for i in range(reps + 3):
            sync()
            t0 = time.perf_counter()
            cache = DynamicCache(config=eng.loaded.text_config)
            out = lm(inputs_embeds=eng.embed(x, None), past_key_values=cache, use_cache=True)
            eng.model.lm_head(out.last_hidden_state[:, -1]).argmax(-1).item()
            sync()
            t1 = time.perf_counter()
            data, _meta = pack_kv(cache)
            t2 = time.perf_counter()
            if i >= 3:
                fwd.append(t1 - t0)
                packs.append(t2 - t1)
    full = [eng.prefill_one(r) for _ in range(2)][-1]
    deferred: dict[str, float] = {}
    if DEVICE.startswith("cuda"):  # the served path: deferred_pack, pinned (default) vs pageable
        from easerve_runtime.engines import hf

        for env in ("1", "0"):
            os.environ[hf.PINNED_ENV] = env
            ts = []
            for _ in range(4):
                o = eng.prefill_one(r)
                sync()
                t0 = time.perf_counter()
                assert o.pack_kv is not None
                o.pack_kv()
                ts.append(time.perf_counter() - t0)
            deferred["pinned" if env == "1" else "pageable"] = round(1e3 * statistics.median(ts[1:]), 2)
        os.environ.pop(hf.PINNED_ENV)
    res = {
        "tokens": 2048,
        "forward_first_token_ms_p50": round(1e3 * statistics.median(fwd), 2),
        "reference_ms": REF["prefill_2048_ms"],
        "ratio_to_reference": round(1e3 * statistics.median(fwd) / REF["prefill_2048_ms"], 3),
        "kv_pack_d2h_ms_p50": round(1e3 * statistics.median(packs), 2),
        "kv_deferred_pack_ms_p50": deferred,
        "kv_bytes": full.kv_bytes,
        "kv_bytes_per_token": full.kv_bytes // 2048,
    }
    log(f"prefill: {res}")
    data = full.kv if full.kv is not None else full.pack_kv() if full.pack_kv is not None else b""
    kv = (data, dict(full.kv_meta))
    del eng, full
    empty_cache()
    return res, kv


# ---------------------------------------------------------------------------------- decode
def fill_slots(eng: Any, n: int, ctx: int, sampling: Any = None) -> list[Any]:
    """n running sequences with a ctx-token random KV each (written straight into the slots)."""
    from easerve_runtime.engines.base import DecodeSequence, Sampling

    eng.slot_of.clear()
    eng.length.clear()
    seqs = []
    for i in range(n):
        rid = f"d{i}"
        eng.slot_of[rid] = i
        eng.length[rid] = ctx
        eng.sampling[rid] = sampling or Sampling(0.0)
        seqs.append(DecodeSequence(rid, ctx, 10**6, generated=[5 + i]))
    eng.K[:, :n, :, :ctx].normal_()
    eng.V[:, :n, :, :ctx].normal_()
    return seqs


def _steps(eng: Any, seqs: list[Any], steps: int, ctx: int) -> float:
    """Median ms of ``_step_sync`` over ``steps`` steps (3 warm-up), lengths reset to ``ctx`` each step."""
    def one() -> float:
        for s in seqs:
            eng.length[s.request_id] = ctx
        sync()
        t0 = time.perf_counter()
        toks = eng._step_sync(seqs)
        dt = time.perf_counter() - t0
        for s, t in zip(seqs, toks, strict=True):
            s.generated.append(t)
        return dt

    for _ in range(3):
        one()
    return 1e3 * statistics.median([one() for _ in range(steps)])


def _replay_ms(eng: Any, n: int, kv_len: int, steps: int) -> float:
    """Median ms of the captured step's replay alone (no host work around it)."""
    g, _st = eng._graphs[(eng._bucket(n), kv_len)]
    lat = []
    for _ in range(steps + 3):
        sync()
        t0 = time.perf_counter()
        g.replay()
        sync()
        lat.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(lat[3:])


def bench_decode(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    from easerve_runtime.engines import hf
    from easerve_runtime.engines.hf import HFDecodeEngine

    ctx = 64 if args.smoke else 2048
    sizes = (1, 4) if args.smoke else (1, 32, 128)
    eng = HFDecodeEngine(d, device=DEVICE, random_weights=True, max_len=ctx + 256, max_slots=max(sizes),
                         memory_fraction=0.9, stage_buffers=0)
    res: dict[str, Any] = {"context": ctx, "slots": eng.slots, "slot_mib": round(eng.slot_bytes / 2**20, 1),
                           "kv_len": hf.kv_bucket(ctx + 1, eng.max_len)}
    steps = 5 if args.smoke else 10 if args.quick else 30
    for graphs in (True, False):
        for b in sizes:
            seqs = fill_slots(eng, b, ctx)
            eng.cuda_graphs = graphs and DEVICE.startswith("cuda")
            ms = _steps(eng, seqs, steps, ctx)
            key = f"{'graph' if graphs else 'eager'}_b{b}"
            res[key] = {"step_ms_p50": round(ms, 2), "tokens_s": round(b / ms * 1e3, 1)}
            if graphs and b in REF["decode_ms"]:
                res[key]["reference_ms"] = REF["decode_ms"][b]
                res[key]["ratio_to_reference"] = round(ms / REF["decode_ms"][b], 3)
            if graphs and eng.cuda_graphs:
                res[key]["replay_only_ms"] = round(_replay_ms(eng, b, res["kv_len"], steps), 2)
            res["graphs_active"] = eng.cuda_graphs if graphs else res.get("graphs_active")
            log(f"decode {key}: {res[key]}")
    if DEVICE.startswith("cuda"):  # the same steps with each attention kernel (graphs recaptured)
        kernels: dict[str, Any] = {}
        for k in hf.DECODE_ATTENTION_KERNELS:
            eng._graphs.clear()
            eng.cuda_graphs = True
            try:
                hf.set_decode_attention_kernel(k)
                kernels[k] = {f"b{b}": round(_steps(eng, fill_slots(eng, b, ctx), steps, ctx), 2) for b in sizes}
                kernels[k]["graphs_active"] = eng.cuda_graphs
            except Exception as exc:  # noqa: BLE001 - a backend that refuses these shapes
                kernels[k] = {"error": repr(exc)[:300]}
            log(f"decode attention {k}: {kernels[k]}")
        hf.set_decode_attention_kernel("sdpa")
        eng._graphs.clear()
        res["attention_kernels_ms"] = kernels
        if args.profile:
            res["profile_eager"] = _profile_decode(eng, ctx)
    del eng
    empty_cache()
    return res


def _profile_decode(eng: Any, ctx: int) -> dict[str, Any]:
    """GPU time per op of eager steps at b1 and b128 (kernel times do not depend on launch overhead)."""
    import torch

    out = {}
    eng.cuda_graphs = False
    for b in (1, 128):
        seqs = fill_slots(eng, b, ctx)
        _steps(eng, seqs, 2, ctx)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _steps(eng, seqs, 5, ctx)
        out[f"b{b}"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
    return out


def bench_decode_load(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    """What a served decode step pays at the served context (~2,900 tokens: one 1080p image): the
    K/V length bucket (3,072 now, 4,096 before), sampling every row at temperature 1, and the
    admission of a handed-over cache: loaded on the loop at admission (before) vs staged on a side
    stream ahead of it (now), and how much a staging copy running beside the steps slows them."""
    import threading

    from easerve_runtime.engines import hf
    from easerve_runtime.engines.base import DecodeSequence, Sampling
    from easerve_runtime.engines.hf import HFDecodeEngine, unpack_kv
    from easerve_runtime.workers.blobs import HostBlobs

    ctx = 100 if args.smoke else 2900
    max_len = 256 if args.smoke else 4096
    b = 4 if args.smoke else 32
    steps = 5 if args.smoke else 10 if args.quick else 30
    eng = HFDecodeEngine(d, device=DEVICE, random_weights=True, max_len=max_len, max_slots=b + 4,
                         memory_fraction=0.9, stage_buffers=2)
    res: dict[str, Any] = {"context": ctx, "batch": b, "max_len": max_len}
    seqs = fill_slots(eng, b, ctx)
    res["step_ms_kv3072"] = round(_steps(eng, seqs, steps, ctx), 2)
    res["kv_len_now"] = hf.kv_bucket(ctx + 1, max_len)
    hf.KV_BUCKET_STEP = 4096  # the old power-of-two bucket at this context
    res["kv_len_before"] = hf.kv_bucket(ctx + 1, max_len)
    res["step_ms_kv4096"] = round(_steps(eng, seqs, steps, ctx), 2)
    hf.KV_BUCKET_STEP = 512
    # sampling: every row at temperature 1 (the OpenAI default the bench sends) vs greedy, GPU time per step
    for name, smp in (("greedy", Sampling(0.0)), ("t1", Sampling(1.0, 1.0, 7)), ("t1_top_p0.9", Sampling(1.0, 0.9, 7))):
        seqs = fill_slots(eng, b, ctx, smp)
        before = dict(eng.stats)
        ms = _steps(eng, seqs, steps, ctx)
        n = eng.stats["steps"] - before["steps"]
        res[f"sampling_{name}"] = {"step_ms_p50": round(ms, 2),
                                   "sample_gpu_ms": round((eng.stats["sample_ms"] - before["sample_ms"]) / max(1, n), 3),
                                   "forward_gpu_ms": round((eng.stats["forward_ms"] - before["forward_ms"]) / max(1, n), 3)}
    log(f"decode_load steps: {res}")
    # admission of one ctx-token cache that arrived as host bytes (a blob taken from /dev/shm)
    shape = [eng.layers, 2, eng.kv_heads, ctx, eng.head_dim]
    import torch

    src = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
    raw = bytearray(memoryview(src.view(torch.int16).numpy()).cast("B"))
    meta = {"shape": shape, "dtype": "bfloat16"}
    res["kv_mib"] = round(len(raw) / 2**20, 1)
    blob_dir = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / f"easerve-bench-{os.getpid()}"
    blobs = HostBlobs(blob_dir)
    t_put, t_take = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        name = blobs.put_sync(raw)
        t1 = time.perf_counter()
        blobs.take_sync(name)
        t_take.append(time.perf_counter() - t1)
        t_put.append(t1 - t0)
    res["blob_put_ms"] = round(1e3 * statistics.median(t_put), 1)
    res["blob_take_ms"] = round(1e3 * statistics.median(t_take), 1)

    def old_admit() -> float:  # what admit did: unpack, pageable .to(device) and slot copies on the caller
        t0 = time.perf_counter()
        kv = unpack_kv(bytearray(raw), meta).to(DEVICE, eng.loaded.dtype)
        for i in range(eng.layers):
            eng.k[i][b, :, :ctx] = kv[i, 0]
            eng.v[i][b, :, :ctx] = kv[i, 1]
        sync()
        return time.perf_counter() - t0

    async def new_admit(pinned: bool) -> tuple[float, float]:
        eng.pinned = pinned
        seq = DecodeSequence("adm", ctx, 8, generated=[1], kv=bytearray(raw), kv_meta=meta)
        t0 = time.perf_counter()
        task = eng.stage(seq)
        assert task is not None
        await task
        t1 = time.perf_counter()
        await eng.admit(seq)
        sync()
        t2 = time.perf_counter()
        ok = bool(torch.equal(eng.K[:, eng.slot_of["adm"], :, :ctx].cpu(), src[:, 0].cpu()))
        eng.release("adm")
        if not ok:
            raise AssertionError("staged cache differs from its bytes")
        return t1 - t0, t2 - t1

    res["admit_before_ms"] = round(1e3 * statistics.median([old_admit() for _ in range(3)]), 1)
    fill_slots(eng, b, ctx)
    for pinned in (False, True):
        runs = [asyncio.run(new_admit(pinned)) for _ in range(3)]
        key = "pinned" if pinned else "pageable"
        res[f"stage_{key}_ms"] = round(1e3 * statistics.median(r[0] for r in runs), 1)
        res[f"admit_after_stage_{key}_ms"] = round(1e3 * statistics.median(r[1] for r in runs), 2)
    eng.pinned = False
    # a staging copy running beside the steps (as under load): how much slower are the steps?
    seqs = fill_slots(eng, b, ctx)
    quiet = _steps(eng, seqs, steps, ctx)
    stop = threading.Event()
    copies = [0]

    def stager(pinned: bool) -> None:
        buf = eng._stage_free[0][0]
        while not stop.is_set():
            eng.pinned = pinned
            eng._to_device(bytearray(raw) if not pinned else raw, meta, buf, None)
            copies[0] += 1

    for pinned in (False, True):
        copies[0] = 0
        stop.clear()
        th = threading.Thread(target=stager, args=(pinned,))
        th.start()
        t0 = time.perf_counter()
        busy = _steps(eng, seqs, steps, ctx)
        el = time.perf_counter() - t0
        stop.set()
        th.join()
        key = "pinned" if pinned else "pageable"
        res[f"steps_beside_staging_{key}"] = {"quiet_ms": round(quiet, 2), "busy_ms": round(busy, 2),
                                              "copies_per_s": round(copies[0] / el, 1)}
    eng.pinned = False
    import shutil

    shutil.rmtree(blob_dir, ignore_errors=True)
    log(f"decode_load admission: {res}")
    eng.K = eng.V = None  # the engine's memory goes with this frame; the next section needs it
    eng.k.clear()
    eng.v.clear()
    eng._stage_free.clear()
    empty_cache()
    return res


# ---------------------------------------------------------------------------------- handoff
def _receiver(port_q: Any, done_q: Any, meta: dict[str, Any]) -> None:
    """The decode side: read framed JSON chunks, base64-decode, reassemble, copy into a GPU slot."""
    import torch
    from easerve_runtime.engines.hf import unpack_kv

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port_q.put(srv.getsockname()[1])
    dst = None
    while True:
        conn, _ = srv.accept()
        f = conn.makefile("rb")
        n_expect, chunks = None, {}
        while True:
            line = f.readline()
            if not line:
                break
            msg = json.loads(line)
            if msg.get("stop"):
                conn.close()
                srv.close()
                return
            c = msg["kv_chunk"]
            chunks[c["seq"]] = base64.b64decode(c["b64"])
            n_expect = c["of"]
            conn.sendall(b'{"ack":true}\n')
            if len(chunks) == n_expect:
                kv = unpack_kv(b"".join(chunks[i] for i in range(n_expect)), meta)
                dev = "cuda" if torch.cuda.is_available() else "cpu"
                if dst is None:
                    dst = torch.empty(kv.shape, dtype=kv.dtype, device=dev)
                dst.copy_(kv)  # pageable H2D, as the decode engine's admit does
                if dev == "cuda":
                    torch.cuda.synchronize()
                done_q.put(time.perf_counter())
                chunks = {}
        conn.close()


def bench_handoff(args: argparse.Namespace, kv: Any, prefill_ms: float) -> dict[str, Any]:
    data, meta = kv
    ctx = get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port_q, done_q, meta), daemon=True)
    p.start()
    port = port_q.get(timeout=120)
    chunk, inflight = 4 << 20, 4

    async def send_once() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = -(-len(data) // chunk)
        view = memoryview(data)
        t0 = time.perf_counter()
        for start in range(0, n, inflight):
            idx = range(start, min(n, start + inflight))
            for i in idx:
                body = base64.b64encode(bytes(view[i * chunk : (i + 1) * chunk])).decode()
                writer.write(json.dumps({"kv_chunk": {"id": "x", "seq": i, "of": n, "b64": body}}).encode() + b"\n")
            await writer.drain()
            for _ in idx:
                await reader.readline()
        done = await asyncio.get_running_loop().run_in_executor(None, done_q.get)
        writer.close()
        return float(done - t0)

    async def run() -> list[float]:
        out = []
        for _ in range(3 if args.quick else 8):
            out.append(await send_once())
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b'{"stop":true}\n')
        await w.drain()
        w.close()
        return out

    times = asyncio.run(run())[1:]
    p.join(10)
    s = statistics.median(times)
    res = {
        "transport": "loopback TCP between two processes, request-plane framing (JSON + base64, 4 MiB chunks, 4 in flight), into a GPU slot",
        "kv_bytes": len(data),
        "seconds_p50": round(s, 4),
        "gb_s": round(len(data) / s / 1e9, 2),
        "share_of_ttft": round(s / (s + prefill_ms / 1e3), 3),
    }
    log(f"handoff: {res}")
    return res


# ---------------------------------------------------------------------------------- split
def bench_split(args: argparse.Namespace, d: Path) -> dict[str, Any]:
    import torch
    from easerve_runtime.engines.base import EncodeInput, MediaPart, PrefillInput, Sampling
    from easerve_runtime.engines.hf import HFEncodeEngine, HFPrefillEngine
    from easerve_runtime.partition.backends import GreenContextPool

    enc = HFEncodeEngine(d, device=DEVICE, random_weights=True)
    pre = HFPrefillEngine(d, device=DEVICE, random_weights=True)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    levels = [s for s in (48, 64, 80, 96, 112) if s < total]
    pool = GreenContextPool(levels)
    msgs = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},)
    img = jpeg(*SIZES["1080p"], seed=1)
    batch = [EncodeInput(f"s{i}", (MediaPart("image", img, "image/jpeg", {}),), 0, msgs) for i in range(8)]
    req = PrefillInput("lp", 2048, 0, 0, None, {"input_ids": list(range(100, 2148))}, Sampling(0.0))
    seconds = 8 if args.quick else 20
    res: dict[str, Any] = {"pool": pool.describe(), "encode_batch": 8, "prefill_tokens": 2048}

    def run(system: str, enc_sms: int | None) -> dict[str, Any]:
        stop = threading.Event()
        lat: list[float] = []
        prefills = [0]
        enc_stream = pool.full_primary if enc_sms is None else pool.primary(enc_sms)
        share = 1.0 if enc_sms is None else pool.levels[enc_sms].partner_sms / total  # the prefill's own share

        def encoder() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                with torch.cuda.stream(enc_stream):
                    enc._encode_sync(batch)
                enc_stream.synchronize()
                lat.append(time.perf_counter() - t0)
                time.sleep(0.01)  # arrivals: ~the batch interval of a loaded encoder

        def prefiller() -> None:
            s = pool.full_partner
            while not stop.is_set():
                if enc_sms is None:
                    with torch.cuda.stream(s):
                        pre.prefill_one(req)
                else:
                    pre.pool = pool
                    pre.prefill_one(req, sm_share=share)
                prefills[0] += 1

        ts = [threading.Thread(target=encoder), threading.Thread(target=prefiller)]
        for t in ts:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in ts:
            t.join()
        out = {"encode_ms_p50": round(1e3 * pct(lat, 0.5), 2), "encode_ms_p99": round(1e3 * pct(lat, 0.99), 2),
               "encode_batches": len(lat), "prefill_per_s": round(prefills[0] / seconds, 2)}
        log(f"split {system}: {out}")
        return out

    run("warmup", None)
    res["none"] = run("none", None)
    for sms in (64, 96):
        if sms in pool.levels:
            res[f"green_{sms}"] = run(f"green_{sms}", sms)
    return res


# ---------------------------------------------------------------------------------- plot
def plot(r: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r.data["sections"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if isinstance(s.get("encode"), dict) and "1080p" in s["encode"]:
        ax = axes[0]
        names = list(SIZES)
        keys = [("passthrough_b1_img_s", "pass-through b1"), ("microbatch_b8_img_s", "GPU b8"),
                ("microbatch_b16_img_s", "GPU b16")]
        for j, (k, lab) in enumerate(keys):
            ax.bar([i + 0.27 * j for i in range(len(names))], [s["encode"][n].get(k, 0) for n in names], 0.27, label=lab)
        ax.axhline(180, ls="--", c="k", lw=0.8, label="goal 1080p")
        ax.set_xticks([i + 0.27 for i in range(len(names))], names)
        ax.set_ylabel("images/s")
        ax.set_title("encode (LLaVA-NeXT anyres)")
        ax.legend(fontsize=8)
    if isinstance(s.get("decode"), dict):
        ax = axes[1]
        bs = [b for b in (1, 32, 128) if f"graph_b{b}" in s["decode"]]
        ax.bar([i - 0.2 for i in range(len(bs))], [s["decode"][f"graph_b{b}"]["step_ms_p50"] for b in bs], 0.4, label="ours (graph)")
        ax.bar([i + 0.2 for i in range(len(bs))], [REF["decode_ms"][b] for b in bs], 0.4, label="reference")
        ax.set_xticks(range(len(bs)), [f"b{b}" for b in bs])
        ax.set_ylabel("ms / step (ctx 2048)")
        ax.set_title("decode 7B")
        ax.legend(fontsize=8)
    if isinstance(s.get("split"), dict):
        ax = axes[2]
        systems = [k for k in ("none", "green_64", "green_96") if k in s["split"]]
        ax.bar(systems, [s["split"][k]["encode_ms_p99"] for k in systems], label="encode p99 ms")
        ax2 = ax.twinx()
        ax2.plot(systems, [s["split"][k]["prefill_per_s"] for k in systems], "o-r", label="prefill/s")
        ax.set_title("local prefill under the split")
        ax.set_ylabel("encode p99 (ms)")
        ax2.set_ylabel("prefills/s")
    fig.tight_layout()
    fig.savefig(r.out / "gpu_engine.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: exercise the code, measure nothing")
    ap.add_argument("--profile", action="store_true", help="add torch.profiler tables (encode B=16, eager decode)")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    import torch
    import transformers

    r = Results(Path(args.out))
    r.data["env"] = {"torch": torch.__version__, "transformers": transformers.__version__, "device": DEVICE,
                     "argv": sys.argv[1:]}
    if DEVICE.startswith("cuda"):
        r.data["env"].update(gpu=torch.cuda.get_device_name(0),
                             sms=torch.cuda.get_device_properties(0).multi_processor_count)
    try:
        import torchvision

        r.data["env"]["torchvision"] = torchvision.__version__
    except ImportError:
        r.data["env"]["torchvision"] = None
    log(f"env: {r.data['env']}")
    d = model_dir(Path(args.out))

    def want(name: str) -> bool:
        return (args.only is None or name in args.only) and name not in args.skip

    kv, prefill_ms = None, REF["prefill_2048_ms"]
    for name in ("encode", "prefill", "decode", "decode_load", "handoff", "split"):
        if not want(name) or (name == "handoff" and kv is None):
            continue
        try:
            t0 = time.perf_counter()
            if name == "encode":
                val: Any = bench_encode(args, d)
            elif name == "prefill":
                val, kv = bench_prefill(args, d)
                prefill_ms = val["forward_first_token_ms_p50"]
            elif name == "decode":
                val = bench_decode(args, d)
            elif name == "decode_load":
                val = bench_decode_load(args, d)
            elif name == "handoff":
                val = bench_handoff(args, kv, prefill_ms)
            else:
                val = bench_split(args, d)
            val["section_s"] = round(time.perf_counter() - t0, 1)
        except Exception as exc:  # keep the other sections
            traceback.print_exc()
            val = {"error": repr(exc)}
        r.put(name, val)
        try:
            plot(r)
        except Exception:
            traceback.print_exc()
    print(json.dumps(r.data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
