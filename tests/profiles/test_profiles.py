"""Profiles reproduce the H200 anchors, order GPUs sensibly and stay monotone."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
from easerve_runtime.profiles import backbone, list_profiles, load_profile

MODELS = ("llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b")
GPUS = ("h200", "a100-80gb", "rtx6000ada")


def _anchors():
    return json.loads(
        resources.files("easerve_runtime.profiles").joinpath("data").joinpath("h200_anchors.json").read_text()
    )


def test_names_and_unknown():
    names = list_profiles()
    assert sorted(names) == sorted(f"{m}@{g}" for m in MODELS for g in GPUS)
    for n in names:
        p = load_profile(n)
        assert p.name == n and p.model == n.split("@")[0] and p.gpu == n.split("@")[1]
    with pytest.raises(ValueError, match="llava-v1.6-34b@rtx6000ada"):
        load_profile("llava-v1.6-34b@h100")
    with pytest.raises(ValueError, match="known profiles"):
        load_profile("nonsense")


def test_examples_name_shipped_profiles():
    from pathlib import Path

    from easerve_runtime.api import load_manifest

    for f in sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml")):
        _, spec = load_manifest(f)
        if spec.mode == "omni-colocated":
            continue  # omni profiles live in easerve_runtime.omni
        p = load_profile(spec.engine.profile)
        assert p.encoder == spec.model.encoder and p.modality == spec.model.modality


def test_h200_anchors_34b_backbone():
    a = _anchors()["backbones"]["llm-34b-class"]
    p = load_profile("llava-v1.6-34b@h200")
    assert p.weight_bytes == pytest.approx(68.8e9, rel=0.01)
    assert p.kv_bytes(1) == 245_760
    for t, ms in a["prefill_ms"].items():
        assert p.prefill_s(int(t)) * 1e3 == pytest.approx(ms, rel=0.02)
    b = a["prefill_batched_ms"]
    assert p.prefill_s(b["sequences"] * b["tokens_each"], sequences=b["sequences"]) * 1e3 == pytest.approx(
        b["ms"], rel=0.03
    )
    for bs, ms in a["decode_ms_ctx2048"].items():
        assert p.decode_step_s(int(bs), int(bs) * 2048) * 1e3 == pytest.approx(ms, rel=0.03)
    for ctx, ms in a["decode_ms_b32"].items():
        assert p.decode_step_s(32, 32 * int(ctx)) * 1e3 == pytest.approx(ms, rel=0.03)


def test_7b_cross_check_within_ten_percent():
    """The 7B class is not fitted for prefill: its prediction is a genuine check of the scaling."""
    a = _anchors()["backbones"]["llm-7b-class"]
    p = dataclasses.replace(load_profile("llava-v1.6-34b@h200"), backbone=backbone("llm-7b-class"))
    assert p.weight_bytes == pytest.approx(14.5e9, rel=0.01)
    assert load_profile("llava-v1.6-34b@h200").decode_step_s(1, 2048) == pytest.approx(
        0.0232, rel=0.01
    )  # untouched
    for t, ms in a["prefill_ms"].items():
        assert p.prefill_s(int(t)) * 1e3 == pytest.approx(ms, rel=0.16)
    for bs, ms in a["decode_ms_ctx2048"].items():
        assert p.decode_step_s(int(bs), int(bs) * 2048) * 1e3 == pytest.approx(ms, rel=0.10)
    for ctx, ms in a["decode_ms_b32"].items():
        assert p.decode_step_s(32, 32 * int(ctx)) * 1e3 == pytest.approx(ms, rel=0.10)


@pytest.mark.parametrize(
    "profile, table, rel",
    [
        ("llava-v1.6-34b@h200", ("clip-vit-l-336", "eager_ms"), 0.05),
        ("ultravox-v0.6-27b@h200", ("whisper-large-v3", "graph_ms"), 0.01),
        ("qwen2.5-vl-32b@h200", ("qwen2-vl-vision", "eager_ms"), 0.01),
    ],
)
def test_h200_encoder_anchors(profile, table, rel):
    p = load_profile(profile)
    enc, key = table
    for b, ms in _anchors()["encoders"][enc][key].items():
        assert p.encode_s(int(b)) * 1e3 == pytest.approx(ms, rel=rel)


def test_sm_share_follows_the_knee_table():
    knee = _anchors()["sm_knee"]
    p = load_profile("llava-v1.6-34b@h200")
    full = knee["sms"]["132"]
    for sms, row in knee["sms"].items():
        for j, b in enumerate(knee["batches"]):
            expect = row[j] / full[j]
            got = p.encode_s(b, int(sms) / 132) / p.encode_s(b, 1.0)
            if b >= 16:  # above the eager floor the whole latency scales
                assert got == pytest.approx(expect, rel=0.02)
            assert got >= 1.0


@pytest.mark.parametrize("model", MODELS)
def test_gpu_ordering(model):
    h, a, r = (load_profile(f"{model}@{g}") for g in GPUS)
    for b in (4, 16, 64):
        assert r.encode_s(b) > a.encode_s(b) > h.encode_s(b)
    for tp in (2, 4):
        assert r.prefill_s(2048, tp=tp) > a.prefill_s(2048, tp=tp) > h.prefill_s(2048, tp=tp)
        assert (
            r.decode_step_s(32, 32 * 2048, tp=tp)
            > a.decode_step_s(32, 32 * 2048, tp=tp)
            > h.decode_step_s(32, 32 * 2048, tp=tp)
        )
    assert r.transfer_s(50_000_000) > a.transfer_s(50_000_000) > h.transfer_s(50_000_000)
    assert r.min_tp() == 2 and h.min_tp() == 1  # the paper: 27–34B need TP >= 2 on 48 GB


@pytest.mark.parametrize("name", [f"{m}@{g}" for m in MODELS for g in GPUS])
def test_monotone(name):
    p = load_profile(name)
    for tp in (1, 2, 4, 8):
        ts = [p.prefill_s(t, tp=tp) for t in (1, 16, 100, 512, 700, 1024, 3000, 8192, 16384, 40000)]
        assert all(x <= y for x, y in zip(ts, ts[1:], strict=False))  # flat while weight-streaming bound
        assert all(x < y for x, y in zip(ts[4:], ts[5:], strict=False))
        for ctx in (0, 100, 2048, 8192):
            ds = [p.decode_step_s(b, b * ctx, tp=tp) for b in (1, 2, 5, 8, 16, 31, 32, 64, 100, 128, 256)]
            if ctx:
                assert all(x < y for x, y in zip(ds, ds[1:], strict=False))
            else:  # the fitted batch term is made monotone with a running max: flat on 16..32
                assert all(x <= y for x, y in zip(ds, ds[1:], strict=False))
        for b in (1, 8, 64):
            cs = [p.decode_step_s(b, c, tp=tp) for c in (0, 10, 1000, 10_000, 100_000, 1_000_000)]
            assert all(x <= y for x, y in zip(cs, cs[1:], strict=False))
        assert p.prefill_s(4096, tp=tp) <= 2 * p.prefill_s(4096, tp=tp, sm_share=0.5)
    es = [p.encode_s(b) for b in range(1, 70)]
    assert all(x <= y for x, y in zip(es, es[1:], strict=False))
    for b in (1, 3, 8, 20, 64):
        shares = [p.encode_s(b, s) for s in (1.0, 0.9, 0.6, 0.3, 0.1, 0.05)]
        assert all(x <= y for x, y in zip(shares, shares[1:], strict=False))
    assert p.prefill_s(0) == 0.0 and p.decode_step_s(0, 0) == 0.0 and p.encode_s(0) == 0.0


def test_sizes_and_transfer():
    p = load_profile("llava-v1.6-34b@rtx6000ada")
    assert p.embedding_bytes(576) == 576 * 7168 * 2
    assert p.transfer_s(0, transfers=1) == pytest.approx(p.hw.link.transfer_setup_s)
    one = p.transfer_s(10_000_000, transfers=1)
    assert p.transfer_s(10_000_000, transfers=4) > one  # envelopes: fewer transfers are cheaper
    g = load_profile("ultravox-v0.6-27b@h200")
    # Gemma 3: past the 1024-token window only the global layers (62 // 6 = 10) keep growing
    assert (g.kv_bytes(8192) - g.kv_bytes(4096)) / 4096 == 10 * 2 * 16 * 128 * 2
    assert g.kv_bytes(1024) == 1024 * 62 * 2 * 16 * 128 * 2
    assert g.kv_budget_bytes(1) > 0 and load_profile("llava-v1.6-34b@rtx6000ada").kv_budget_bytes(1) < 0


def test_media_to_items_and_tokens():
    p = load_profile("llava-v1.6-34b@rtx6000ada")
    assert p.items_tokens({"height": 256, "width": 256})[0] == 3
    assert p.items_tokens({"height": 720, "width": 1280})[0] == 5
    assert p.tokens_per_item() == 576 and p.tokens_per_item("image") == 576
    with pytest.raises(ValueError, match="modality"):
        p.tokens_per_item("input_audio_wrong")
    v = load_profile("qwen2.5-vl-32b@h200")
    assert v.items_tokens({"frames": 16}) == (8, 8 * 256)
    a = load_profile("ultravox-v0.6-27b@h200")
    assert a.items_per_request({"audio_s": 35.0}) == 2


def test_local_prefill_efficiency():
    p = load_profile("llava-v1.6-34b@h200")
    k = p.calib.kappa
    assert 0.9 < k <= 1.0
    assert p.local_prefill_efficiency(0.5) == pytest.approx(0.5 * k)
    assert p.local_prefill_efficiency(0.5, encode_busy=0.0) == 1.0
    assert p.prefill_s(2048) / p.prefill_s(2048, sm_share=0.5) == pytest.approx(
        p.local_prefill_efficiency(0.5)
    )
    with pytest.raises(ValueError, match="encode_sm_share"):
        p.local_prefill_efficiency(1.0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.encode_s(4, 0.0), "sm_share"),
        (lambda p: p.prefill_s(100, tp=3), "tp"),
        (lambda p: p.prefill_s(100, sm_share=1.5), "sm_share"),
        (lambda p: p.decode_step_s(4, 100, tp=16), "tp"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(load_profile("llava-v1.6-34b@h200"))
