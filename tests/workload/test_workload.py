"""Workloads: seeded generation, arrival statistics, encoder patching, traces, metrics."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from easerve_runtime.api import SLOSpec, load_manifest
from easerve_runtime.workload import (
    Request,
    RequestRecord,
    generate,
    interarrival_gaps,
    items_tokens,
    percentile,
    read_trace,
    summarize,
    write_trace,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    m: ROOT / "examples" / f"{m}.yaml" for m in ("llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b")
}


def spec_of(name: str):
    return load_manifest(EXAMPLES[name])[1]


def test_seeded_generation_is_deterministic_and_seed_sensitive() -> None:
    s = spec_of("llava-v1.6-34b")
    assert generate(s, 2.0, 50, seed=7) == generate(s, 2.0, 50, seed=7)
    assert generate(s, 2.0, 50, seed=7) != generate(s, 2.0, 50, seed=8)


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 2.0)])
def test_interarrival_mean_and_cv(arrival: str, cv: float) -> None:
    gaps = interarrival_gaps(4.0, 20000, random.Random(3), arrival, cv)
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(0.25, rel=0.05)
    assert sd / mean == pytest.approx(cv, rel=0.08)


def test_bad_arrival_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="rate"):
        interarrival_gaps(0.0, 3, random.Random(0))
    with pytest.raises(ValueError, match="arrival"):
        interarrival_gaps(1.0, 3, random.Random(0), "uniform")
    with pytest.raises(ValueError, match="cv"):
        interarrival_gaps(1.0, 3, random.Random(0), "gamma", 0.0)


def test_encoder_patching() -> None:
    assert items_tokens("image", {"height": 336, "width": 336}) == (1, 576)
    # LLaVA-1.6 anyres: 256x256 -> 336x672 grid (2 tiles + base); 720x1280 -> 672x672 (4 + base)
    assert items_tokens("image", {"height": 256, "width": 256}, anyres=True) == (3, 576 + 24 * 24 + 24)
    items, tokens = items_tokens("image", {"height": 720, "width": 1280}, anyres=True)
    assert items == 5 and 576 < tokens <= 2880 + 48
    assert items_tokens("video", {"frames": 8}) == (4, 1024)
    assert items_tokens("video", {"frames": 31}) == (16, 4096)
    assert items_tokens("audio", {"audio_s": 35.0}) == (2, 219)


def test_modality_mix_follows_the_issue() -> None:
    img = generate(spec_of("llava-v1.6-34b"), 2.0, 400, seed=1)
    sizes = {(r.media["height"], r.media["width"]) for r in img}
    assert sizes == {(256, 256), (720, 1280)}
    big = sum(1 for r in img if r.media["height"] == 720)
    assert 150 < big < 250  # half each
    vid = generate(spec_of("qwen2.5-vl-32b"), 2.0, 400, seed=1)
    assert all(8 <= r.media["frames"] <= 32 for r in vid)
    aud = generate(spec_of("ultravox-v0.6-27b"), 2.0, 400, seed=1)
    assert all(2.0 <= r.media["audio_s"] <= 35.0 for r in aud)
    assert all(r.output_tokens >= 1 and r.prefill_tokens >= 1 for r in img + vid + aud)


def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = generate(spec_of("qwen2.5-vl-32b"), 3.0, 40, seed=2)
    p = tmp_path / "t.jsonl"
    write_trace(p, reqs)
    assert read_trace(p) == reqs


@pytest.mark.parametrize(
    "line,match",
    [
        ({"id": "a", "arrival_s": 0.0, "modality": "image", "bogus": 1}, "unknown field"),
        ({"id": "a", "modality": "image"}, "missing field"),
        ({"id": "a", "arrival_s": "soon", "modality": "image"}, "arrival_s"),
        (
            {"id": "a", "arrival_s": 0.0, "modality": "image", "media_tokens": 5, "output_tokens": 0},
            "output_tokens",
        ),
    ],
)
def test_bad_trace_lines_are_rejected_naming_line_and_field(tmp_path: Path, line: dict, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=match) as ei:
        read_trace(p)
    assert ":1:" in str(ei.value)


def test_duplicate_ids_and_unsorted_arrivals_are_rejected(tmp_path: Path) -> None:
    r = Request(id="a", arrival_s=1.0, modality="text", prompt_tokens=3)
    p = tmp_path / "dup.jsonl"
    write_trace(p, [r, r])
    with pytest.raises(ValueError, match="duplicate"):
        read_trace(p)
    write_trace(p, [r, Request(id="b", arrival_s=0.5, modality="text", prompt_tokens=3)])
    with pytest.raises(ValueError, match="arrival_s"):
        read_trace(p)


SLO = SLOSpec.model_validate(
    {
        "objective": "moderate",
        "tiers": [
            {"name": "strict", "ttftSeconds": 1, "tpotMs": 50},
            {"name": "moderate", "ttftSeconds": 4, "tpotMs": 100},
        ],
    }
)


def test_summarize_by_hand() -> None:
    recs = [
        # ttft 0.5, tpot (2.5-0.5)/40 = 50 ms: good for both tiers
        RequestRecord(id="a", arrival_s=0.0, output_tokens=41, first_token_s=0.5, finish_s=2.5),
        # ttft 3, tpot 75 ms: moderate only
        RequestRecord(id="b", arrival_s=1.0, output_tokens=11, first_token_s=4.0, finish_s=4.75),
        # ttft 5: neither
        RequestRecord(id="c", arrival_s=2.0, output_tokens=1, first_token_s=7.0, finish_s=7.0),
        RequestRecord(id="d", arrival_s=3.0, output_tokens=5, error="decode worker died"),
    ]
    s = summarize(recs, SLO)
    assert s["requests"] == 4 and s["completed"] == 3 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(7.0)
    assert s["throughput"] == pytest.approx(3 / 7)
    assert s["goodput"] == {"strict": pytest.approx(1 / 7), "moderate": pytest.approx(2 / 7)}
    assert s["ttft_mean"] == pytest.approx((0.5 + 3 + 5) / 3)
    assert s["tpot_mean"] == pytest.approx((0.05 + 0.075 + 0.0) / 3)
    assert s["ttft_p99"] == pytest.approx(percentile([0.5, 3.0, 5.0], 99))
    assert s["attainment"]["moderate"] == pytest.approx(0.5)
    assert "token2_gap" not in s  # no record saw its second token


def test_summarize_reports_the_second_tokens_gap_where_it_was_seen() -> None:
    recs = [
        RequestRecord(id="a", arrival_s=0.0, output_tokens=41, first_token_s=0.5, finish_s=2.5, second_token_s=0.8),
        RequestRecord(id="b", arrival_s=1.0, output_tokens=11, first_token_s=4.0, finish_s=4.75, second_token_s=4.1),
        RequestRecord(id="c", arrival_s=2.0, output_tokens=1, first_token_s=7.0, finish_s=7.0),  # one token only
    ]
    gap = summarize(recs, SLO)["token2_gap"]
    assert gap["mean"] == pytest.approx((0.3 + 0.1) / 2)
    assert gap["p50"] == pytest.approx(percentile([0.3, 0.1], 50))


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 99))
