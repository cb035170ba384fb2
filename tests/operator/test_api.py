"""The spec models: valid specs round-trip, invalid ones name the offending field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_operator.api.crd import CRD_FILENAME, build_crd, crd_yaml
from easerve_runtime.api import EPDDeploymentSpec, load_manifest, parse_spec, spec_errors
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

TIERS = [{"name": n, "ttftSeconds": t, "tpotMs": p}
         for n, t, p in [("strict", 2, 60), ("tight", 4, 80), ("moderate", 8, 100), ("loose", 16, 150), ("relaxed", 32, 250)]]


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Disaggregated specs that satisfy every cross-field rule."""
    tp = st.sampled_from([1, 2, 4, 8])
    e = draw(st.integers(1, 8))
    p_rep, p_tp = draw(st.integers(0, 4)), draw(tp)
    d_rep, d_tp = draw(st.integers(1, 4)), draw(tp)
    gpus = e + p_rep * p_tp + d_rep * d_tp
    s = 0.0 if p_rep == 0 else draw(st.floats(0, 1, allow_nan=False))
    mode = "none" if s >= 1 else draw(st.sampled_from(["none", "dynamic"]))
    return {
        "model": {"name": draw(st.text("abcdef-/", min_size=1, max_size=20)),
                  "modality": draw(st.sampled_from(["image", "video", "audio"])),
                  "encoder": "clip-vit-l-336"},
        "engine": {"backend": "sim", "profile": "llava-v1.6-34b@h200"},  # torch/vllm rules: tests/engines/test_spec_rules.py
        "gpuBudget": gpus + draw(st.integers(0, 8)),
        "allocation": {"encode": {"replicas": e, "tensorParallel": 1},
                       "prefill": {"replicas": p_rep, "tensorParallel": p_tp},
                       "decode": {"replicas": d_rep, "tensorParallel": d_tp}},
        "encode": {"batchBound": draw(st.integers(1, 256)),
                   "dispatch": draw(st.sampled_from(["poisson-gap", "fixed-timeout", "eager"])),
                   "maxAgeMs": draw(st.floats(0.1, 10_000)), "gapQuantile": draw(st.floats(0.01, 0.99))},
        "offload": {"ratio": s},
        "smPartition": {"mode": mode, "backend": "green-context"},
        "slo": {"objective": draw(st.sampled_from([t["name"] for t in TIERS])), "tiers": TIERS},
        "tuning": {"enabled": False, "trialBudget": draw(st.integers(1, 100))},
    }


@settings(max_examples=150, deadline=None)
@given(valid_specs())
def test_valid_specs_round_trip(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw)
    wire = spec.wire()
    assert parse_spec(wire) == spec
    # the wire form is camelCase and carries every field the user gave
    assert wire["allocation"]["encode"]["tensorParallel"] == 1
    assert wire["encode"]["batchBound"] == raw["encode"]["batchBound"]


# (mutation applied to a valid spec, the field path the error must name)
INVALID = [
    (lambda r: r.__setitem__("gpuBudget", 1) or r["allocation"]["encode"].__setitem__("replicas", 2), "spec.allocation"),
    (lambda r: r["encode"].__setitem__("batchBound", 0), "spec.encode.batchBound"),
    (lambda r: r["encode"].__setitem__("batchBound", 1000), "spec.encode.batchBound"),
    (lambda r: r["encode"].__setitem__("gapQuantile", 1.0), "spec.encode.gapQuantile"),
    (lambda r: r["encode"].__setitem__("dispatch", "greedy"), "spec.encode.dispatch"),
    (lambda r: r["encode"].__setitem__("bogus", 1), "spec.encode.bogus"),
    (lambda r: r["offload"].__setitem__("ratio", 1.5), "spec.offload.ratio"),
    (lambda r: r["allocation"]["decode"].__setitem__("tensorParallel", 3), "spec.allocation.decode.tensorParallel"),
    (lambda r: r["allocation"]["encode"].__setitem__("tensorParallel", 2), "spec.allocation.encode.tensorParallel"),
    (lambda r: r["allocation"]["decode"].__setitem__("replicas", 0), "spec.allocation.decode.replicas"),
    (lambda r: r["slo"].__setitem__("objective", "gold"), "spec.slo.objective"),
    (lambda r: r["tuning"].__setitem__("enabled", True), "spec.tuning.targetRate"),
    (lambda r: r["tuning"].__setitem__("objective", "goodput@gold"), "spec.tuning.objective"),
    (lambda r: r.__setitem__("omni", {"classes": [{"name": "text", "output": "text"}]}), "spec.omni"),
    (lambda r: r["model"].__setitem__("modality", "smell"), "spec.model.modality"),
    (lambda r: r.pop("slo"), "spec.slo"),
]


@settings(max_examples=40, deadline=None)
@given(valid_specs(), st.sampled_from(range(len(INVALID))))
def test_invalid_specs_name_the_field(raw: dict[str, Any], which: int) -> None:
    mutate, path = INVALID[which]
    mutate(raw)
    with pytest.raises(ValidationError) as info:
        parse_spec(raw)
    lines = spec_errors(info.value)
    assert any(line.startswith(path) for line in lines), (path, lines)


def test_local_prefill_rules() -> None:
    raw = yaml.safe_load((REPO / "examples" / "llava-v1.6-34b.yaml").read_text())["spec"]
    raw["offload"]["ratio"] = 0.5
    raw["allocation"]["prefill"]["replicas"] = 0
    with pytest.raises(ValidationError) as info:
        parse_spec(raw)
    assert any(line.startswith("spec.offload.ratio") for line in spec_errors(info.value))
    raw = yaml.safe_load((REPO / "examples" / "qwen2.5-vl-32b.yaml").read_text())["spec"]
    raw["smPartition"]["mode"] = "dynamic"  # s = 1: nothing shares the encode GPU
    with pytest.raises(ValidationError) as info:
        parse_spec(raw)
    assert spec_errors(info.value)[0].startswith("spec.smPartition.mode")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid_and_use_the_five_tiers(path: Path) -> None:
    name, spec = load_manifest(path)
    assert isinstance(spec, EPDDeploymentSpec) and name
    if spec.mode == "disaggregated":
        assert [t.name for t in spec.slo.tiers] == ["strict", "tight", "moderate", "loose", "relaxed"]
        ttft = [t.ttft_seconds for t in spec.slo.tiers]
        assert ttft == sorted(ttft), "tiers run from strict to relaxed"
        assert spec.allocation.gpus <= spec.gpu_budget == 8


def test_committed_crd_matches_the_models() -> None:
    committed = (REPO / "crds" / CRD_FILENAME).read_text()
    assert committed == crd_yaml(), "crds/ is stale: run `easerve crd > crds/" + CRD_FILENAME + "`"


def test_crd_shape() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["group"] == "easerve.io" and version["name"] == "v1alpha1"
    assert crd["spec"]["names"]["shortNames"] == ["epd"]
    assert version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Phase", "Ready", "E/P/D", "B", "s", "Tuning", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    b = spec["properties"]["encode"]["properties"]["batchBound"]
    assert (b["type"], b["minimum"], b["maximum"]) == ("integer", 1, 256)
    q = spec["properties"]["encode"]["properties"]["gapQuantile"]
    assert q["exclusiveMinimum"] is True and q["exclusiveMaximum"] is True
    assert spec["properties"]["smPartition"]["properties"]["mode"]["enum"] == ["none", "static", "dynamic"]

    def keys(node: Any) -> set[str]:
        if isinstance(node, dict):
            return set(node) | {k for v in node.values() for k in keys(v)}
        if isinstance(node, list):
            return {k for v in node for k in keys(v)}
        return set()

    found = keys(crd)
    assert "default" not in found, "defaults stay out of the CRD (GitOps drift)"
    assert not {"$ref", "anyOf", "$defs", "title"} & found, "a structural schema has no $ref/anyOf/title"


def test_api_doc_reference_is_generated_from_the_models() -> None:
    from easerve_operator.api.reference import field_reference

    doc = (REPO / "docs" / "api.md").read_text()
    assert field_reference() in doc, "docs/api.md is stale: replace its field reference with `easerve crd docs`"


def small(**kw: Any) -> dict[str, Any]:
    return {"model": {"name": "m", "modality": "image", "encoder": "clip-vit-l-336"},
            "engine": {"backend": "sim", "profile": "llava-v1.6-34b@h200"},
            "slo": {"objective": "moderate", "tiers": TIERS}, **kw}


def test_a_two_gpu_budget_without_an_allocation_runs_encode_with_local_prefill_and_decode() -> None:
    spec = parse_spec(small(gpuBudget=2))
    assert spec.allocation.label() == "1E-0P-1D" and spec.allocation.gpus == 2
    assert spec.offload.ratio == 0.0  # no remote prefill worker: every prefill local
    assert "allocation" not in spec.model_fields_set  # still the search's to fill (spec.tuning)
    assert parse_spec(spec.model_dump(by_alias=True)) == spec  # the runtime config round-trips
    tuned = parse_spec(small(gpuBudget=2, tuning={"enabled": True, "targetRate": 2.0}))
    assert tuned.allocation.gpus <= 2
    # an explicit allocation without remote prefill defaults s to 0 too; an explicit s is kept (and checked)
    own = small(gpuBudget=4, allocation={"encode": {"replicas": 2}, "prefill": {"replicas": 0}, "decode": {"replicas": 2}})
    assert parse_spec(own).offload.ratio == 0.0
    with pytest.raises(ValidationError, match="spec.offload.ratio: is 0.5 but spec.allocation.prefill.replicas is 0"):
        parse_spec({**own, "offload": {"ratio": 0.5}})
    # three GPUs and more keep one GPU per pool; other modes keep the plain default they require
    assert parse_spec(small(gpuBudget=3)).allocation.label() == "1E-1P-1D"
    agg = parse_spec(small(gpuBudget=2, mode="aggregated"))
    assert agg.allocation.label() == "1E-1P-1D" and agg.offload.ratio == 1.0


def test_one_gpu_without_an_allocation_points_to_the_aggregated_mode() -> None:
    with pytest.raises(ValidationError, match=r"spec.gpuBudget: is 1: .*spec.mode: aggregated"):
        parse_spec(small(gpuBudget=1))
    with pytest.raises(ValidationError, match=r"spec.allocation: needs 3 GPUs \(1E-1P-1D\), more than spec.gpuBudget=1"):
        parse_spec(small(gpuBudget=1, allocation={"encode": {"replicas": 1}}))
