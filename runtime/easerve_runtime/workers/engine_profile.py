"""Measure a deployment's torch engine stage by stage and write the profile file the twin reads.

What ``easerve profile --engine torch -f SPEC -o PROFILE`` runs, on the machine's device (the GPU
when torch sees one; ``EASERVE_DEVICE`` overrides). The chain is the serving path's, in one
process, so every stage gets real inputs:

1. **encode**: the deployment's workload (``workload.generate``, seeded; images sent as PNG or
   JPEG, as ``easerve bench --image-format`` sends them), parsed by the frontend's own chat parser, encoded in micro-batches of B requests for each B asked (the same batch
   timed ``reps`` times after a warm-up at its shapes; the median is the point). A point is (encoder items of the batch, ms): items as the twin counts
   them (``Request.encoder_items``), so the ratio is taken on the twin's own axis.
2. **prefill**: each request's real embedding rows and token ids through the prefill engine, one
   prompt at a time (as the engine prefills), timed to the first token after one untimed run
   at that length. The KV cache's
   device-to-host copy is not in it (it runs after the first token, on the handoff path), and is
   reported apart as ``kv_pack_ms``.
3. **decode**: B copies of a real prefilled cache admitted into decode slots, then steps timed
   at each B asked (CUDA graphs when on a GPU, as served); a point is (B, KV tokens in all, ms).

The file names ``<spec.model.name>@<gpu>`` and carries the model's backbone shape read from its
``config.json`` (so the model part is exact), the encoder the spec names, and the points under
``engine``. Whether the model tiles images (anyres) follows the workload generator's rule
(``workload.media.is_anyres`` of the served name), so the twin counts items as the measured
points did. What is not measured here, and stays the shipped model's: the transfer link (users
set its per-path setup for their fabric, ``links``), TP > 1, SM shares below 1.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.engines.base import DecodeSequence, Embedding, PrefillInput, Sampling
from easerve_runtime.workers.encode import embedding_array  # the rows as the envelope carries them

Progress = Callable[[str], None]
STAGES = ("encode", "prefill", "decode")


def _quiet(_msg: str) -> None:
    return None


def backbone_of(model_path: str) -> dict[str, Any]:
    """The backbone entry (``models.json`` schema) of a model directory's language model."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    heads = int(tc["num_attention_heads"])
    hidden = int(tc["hidden_size"])
    return {
        "layers": int(tc["num_hidden_layers"]),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(tc.get("num_key_value_heads") or heads),
        "head_dim": int(tc.get("head_dim") or hidden // heads),
        "ffn": int(tc["intermediate_size"]),
        "vocab": int(tc["vocab_size"]),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
        "gated_mlp": True,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


async def _timed(device: str, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Milliseconds of ``await fn(*args)``, the device synchronised on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    out = await fn(*args)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


async def measure(
    spec: EPDDeploymentSpec,
    *,
    encode_batches: Sequence[int] = (1, 2, 4, 8, 16),
    decode_batches: Sequence[int] = (1, 4, 16, 32),
    requests: int = 16,
    reps: int = 3,
    seed: int = 0,
    stages: Sequence[str] = STAGES,
    image_format: str = "png",
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """The ``engine`` section's points, plus what the report prints (see the module docstring).

    ``stages`` picks what is timed; the chain still runs as far as the last stage asked needs (a
    decode needs a real prefilled cache, a prefill real embeddings)."""
    bad = sorted(set(stages) - set(STAGES))
    if bad or not stages:
        raise ValueError(f"stages: expected some of {', '.join(STAGES)}, got {list(stages)}")
    from easerve_runtime.engines.torch import make_torch_engine, pick_device
    from easerve_runtime.workers.stage_profile import encode_inputs
    from easerve_runtime.workload import generate

    device = pick_device()
    reqs = generate(spec, 1.0, max(requests, max(encode_batches)), seed)
    inputs = encode_inputs(spec, reqs, image_format)
    items = {r.id: r.encoder_items for r in reqs}
    out: dict[str, Any] = {"engine": "torch", "device": _device_name(device), "encode": [], "prefill": [],
                           "decode": [], "image_format": image_format}
    t_start = time.perf_counter()

    # ---------------------------------------------------------------- encode
    enc = make_torch_engine(spec, "encode")
    await enc.encode(inputs[:1])  # warm-up: kernels, processor
    n = len(inputs)
    for b in encode_batches if "encode" in stages else ():
        batch = [inputs[i % n] for i in range(b)]  # the same batch each time: one point, its median
        await enc.encode(batch)  # warm-up at this batch's shapes
        times = [(await _timed(device, enc.encode, batch))[0] for _ in range(reps)]
        out["encode"].append({"items": sum(items[x.request_id] for x in batch), "ms": round(statistics.median(times), 3)})
        progress(f"encode B={b}: {out['encode'][-1]['ms']:.1f} ms ({out['encode'][-1]['items']} items)")
    embs: list[Embedding] = []
    need = requests if "prefill" in stages else 1 if "decode" in stages else 0
    for i in range(0, need, max(encode_batches)):
        embs += await enc.encode(inputs[i : min(need, i + max(encode_batches))])
    del enc
    _free(device)
    if not embs:
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        return out

    # ---------------------------------------------------------------- prefill
    pre = make_torch_engine(spec, "prefill")
    # the aggregated worker (workers/aggregated.py) runs an iteration's prefill and its decode step
    # as two engine calls, and this engine prefills whole prompts: the twin's aggregated replica
    # then times their sum, not vLLM's fused chunk (sim/aggregated.py)
    out["mixed_iteration"] = "sequential"
    pins = [
        PrefillInput(e.request_id, int(e.extra["text_tokens"]), e.tokens, 0, embedding=embedding_array(e), extra=dict(e.extra),
                     sampling=Sampling())
        for e in embs
    ]
    await pre.prefill(pins[:1])  # warm-up
    kept = None
    packs = []
    for p in pins:
        # The first call at a prompt's length is what serving pays: served prompts seldom repeat a
        # length, and the first call of a shape costs more than a repeat (the gap is what
        # ``warm_ms``, the same prompt again at once, shows). The twin times prefill by ``ms``.
        ms, outs = await _timed(device, pre.prefill, [p])
        warm_ms, outs = await _timed(device, pre.prefill, [p])
        if "prefill" in stages:
            out["prefill"].append({"tokens": len(p.extra["input_ids"]), "ms": round(ms, 3), "warm_ms": round(warm_ms, 3)})
        o = outs[0]
        t0 = time.perf_counter()
        kv = o.pack_kv() if o.pack_kv is not None else o.kv
        packs.append((time.perf_counter() - t0) * 1e3)
        if kept is None or int(o.kv_meta.get("tokens", 0)) > int(kept[1].get("tokens", 0)):
            kept = (kv, dict(o.kv_meta), o.first_token)
    if out["prefill"]:
        progress(f"prefill: {len(pins)} prompts, median {statistics.median(p['ms'] for p in out['prefill']):.1f} ms")
    out["kv_pack_ms_p50"] = round(statistics.median(packs), 3)
    del pre
    _free(device)
    if "decode" not in stages:
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        return out

    # ---------------------------------------------------------------- decode
    assert kept is not None
    kv, meta, first = kept
    ctx = int(meta["shape"][3])
    dec = make_torch_engine(spec, "decode")
    out["decode_slots"] = int(dec.slots)
    max_tokens = max(1, int(dec.max_len) - ctx)
    steps = max(2, 4 * reps)
    for b in decode_batches:
        if b > dec.slots:
            progress(f"decode B={b}: skipped, the engine holds {dec.slots} slots")
            continue
        seqs = [DecodeSequence(f"p{b}-{i}", ctx, max_tokens, generated=[first], kv=kv, kv_meta=meta)
                for i in range(b)]
        for s in seqs:
            await dec.admit(s)
        step_ms: list[float] = []
        warm = min(3, max_tokens - 1)
        for k in range(warm + steps):
            if len(seqs[0].generated) >= max_tokens:
                break
            ms, toks = await _timed(device, dec.decode_step, seqs)
            for s, t in zip(seqs, toks, strict=True):
                s.generated.append(t)
            if k >= warm:
                step_ms.append(ms)
        for s in seqs:
            dec.release(s.request_id)
        if step_ms:
            mean_ctx = ctx + warm + len(step_ms) / 2.0
            out["decode"].append({"batch": b, "context_tokens": int(b * mean_ctx), "ms": round(statistics.median(step_ms), 3)})
            progress(f"decode B={b}: {out['decode'][-1]['ms']:.2f} ms/step")
    del dec
    _free(device)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def profile_document(spec: EPDDeploymentSpec, measured: dict[str, Any], gpu: str) -> dict[str, Any]:
    """The profile file: ``<model>@<gpu>``, the model's exact backbone, and the measured points."""
    from easerve_runtime.profiles import spec_profile
    from easerve_runtime.workload.media import is_anyres

    assert spec.model.path, "spec.model.path"
    base = spec_profile(spec)
    name = spec.model.name
    bb = f"{name}-backbone"
    engine = {k: measured[k] for k in ("engine", "device", "encode", "prefill", "decode")}
    if measured.get("mixed_iteration"):
        engine["mixed_iteration"] = measured["mixed_iteration"]
    return {
        "_doc": (f"measured by easerve profile --engine torch on {measured['device']} "
                 f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}); "
                 f"{measured.get('image_format')} images; kv_pack_ms_p50 {measured.get('kv_pack_ms_p50')}, "
                 f"decode slots {measured.get('decode_slots')}"),
        "profile": f"{name}@{gpu}",
        "models": {
            "backbones": {bb: backbone_of(spec.model.path)},
            "models": {name: {"hf": str(spec.model.path), "modality": str(spec.model.modality),
                              "encoder": spec.model.encoder or base.encoder, "backbone": bb,
                              "anyres": is_anyres(name)}},
        },
        "engine": engine,
    }


def run(spec: EPDDeploymentSpec, out_path: Path, *, gpu: str | None = None, progress: Progress = _quiet,
        **kw: Any) -> dict[str, Any]:
    """Measure, write ``out_path``, and check the file reads back as a profile; returns the report."""
    from easerve_runtime.profiles import load_profile_file, spec_profile

    measured = asyncio.run(measure(spec, progress=progress, **kw))
    doc = profile_document(spec, measured, gpu or spec_profile(spec).gpu)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    prof = load_profile_file(out_path)
    assert prof.corrections is not None
    return {"profile": doc["profile"], "path": str(out_path), "wall_s": measured["wall_s"],
            "kv_pack_ms_p50": measured.get("kv_pack_ms_p50"), "ratios": prof.corrections.summary()}
