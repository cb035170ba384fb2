"""Issue 17 item 5 on the CPU: ``has_hardware.py --plan`` (HAS on the calibrated twin, small), its
``--summary`` verdict on synthetic result files, and ``--deploy``'s skipping. No GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from easerve_operator.tuning.selection import DEFAULT_TIE_TOLERANCE
from easerve_operator.tuning.space import Alloc
from easerve_runtime.api import parse_spec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_serve  # noqa: E402
import has_hardware  # noqa: E402
from gpu_systems import parse  # noqa: E402


def spec_of(system: str) -> dict:
    return gpu_serve.spec_doc(system, Path("/models/llava"), 4.0, 0.45)["spec"]


# ------------------------------------------------------------------ --plan
@pytest.fixture(scope="module")
def small_plan() -> dict:
    return has_hardware.plan(3.5, pods=3, requests=40, trials=8, progress=False)


def test_the_plan_picks_a_point_of_has_space_and_names_it_deployably(small_plan: dict) -> None:
    space = small_plan["space"]
    # at most 3 pods, TP 1: on one host GPU a layout of fewer pods (1E-0P-1D) is in the space too
    assert space["allocations"] == ["1E-0P-1D", "1E-0P-2D", "1E-1P-1D", "2E-0P-1D"]
    top = small_plan["top"]
    assert small_plan["pick"] == top[0]["system"] and 1 <= len(top) <= 3
    assert len({t["system"] for t in top}) == len(top)
    for t in top:
        sys_ = parse(t["system"])
        assert Alloc.from_dict(t["alloc"]) == sys_.layout and t["allocation"] in space["allocations"]
        assert 1 <= sys_.batch_bound <= space["max_batch"] and sys_.offload == t["offload_ratio"]
        parse_spec(spec_of(t["system"]))
        # the spec the name deploys is the one HAS's trial ran: the twin says the same of both
        assert t["twin"]["goodput"] == pytest.approx(t["has_trial_goodput"], abs=1e-4)
    assert [t["has_trial_goodput"] for t in top][1:] == sorted((t["has_trial_goodput"] for t in top[1:]), reverse=True)
    assert small_plan["groups"]["baselines"] == ["dynamo-style:e1p1d1", "aggregated@1024", "aggregated@2048",
                                                 "aggregated@4096"]
    for name in small_plan["groups"]["has"] + small_plan["groups"]["baselines"]:
        parse_spec(spec_of(name))


def test_a_plan_under_mps_caps_names_and_predicts_every_system_capped(tmp_path: Path) -> None:
    """``--plan --mps 85``: HAS searches on the twin whose pods share the GPU under MPS caps
    (``sim.mpsshare``); every EAServe candidate and Dynamo-style baseline is named ``+mps85``, and
    the twin's prediction for each name is the trial HAS ran (the same caps, unpartitioned)."""
    plan = has_hardware.plan(7.0, pods=3, requests=40, trials=6, progress=False, mps=85)
    assert plan["mps"] == 85
    for t in plan["top"]:
        assert t["system"].endswith("+mps85") and parse(t["system"]).mps == 85
        assert t["twin"]["goodput"] == pytest.approx(t["has_trial_goodput"], abs=1e-4)
    assert plan["groups"]["baselines"][0] == "dynamo-style:e1p1d1+mps85"
    sliced = has_hardware.predict("dynamo-style:e1p1d1", 7.0, 40, tmp_path)
    capped = next(b for b in plan["baselines"] if b["system"] == "dynamo-style:e1p1d1+mps85")["twin"]
    assert capped != sliced  # the capped twin is not the time-sliced one


def test_several_caps_make_the_cap_a_dimension_of_the_plan(tmp_path: Path) -> None:
    """``--plan --mps 70,85``: HAS runs under each cap, and the plan's pick is the best of the two
    searches' picks by the tuner's own ranking: the same system and goodput as the better of the
    two one-cap plans, its cap recorded; Dynamo-style is swept over both caps."""
    one = {cap: has_hardware.plan(7.0, pods=3, requests=40, trials=6, progress=False, mps=cap) for cap in (70, 85)}
    both = has_hardware.plan(7.0, pods=3, requests=40, trials=6, progress=False, mps=[70, 85])
    assert both["mps_searched"] == [70, 85] and both["has"]["trial_budget"] == 12
    assert both["has"]["trials"] == one[70]["has"]["trials"] + one[85]["has"]["trials"]
    better = max(one.values(), key=lambda p: p["top"][0]["has_trial_goodput"])
    assert both["pick"] == better["pick"] and both["mps"] == better["mps"] == parse(both["pick"]).mps
    assert both["top"][0]["has_trial_goodput"] == pytest.approx(better["top"][0]["has_trial_goodput"])
    tried = {t["system"] for p in one.values() for t in p["has"]["tried"]}
    assert {t["system"] for t in both["top"]} <= tried and len(both["top"]) == 3
    # ranked by the tuner (goodput within its tie tolerance, then TTFT and TPOT): none beats the pick
    best = both["top"][0]["has_trial_goodput"]
    assert all(t["has_trial_goodput"] <= best * (1 + DEFAULT_TIE_TOLERANCE) + 1e-4 for t in both["top"])
    assert both["groups"]["baselines"][:2] == ["dynamo-style:e1p1d1+mps70", "dynamo-style:e1p1d1+mps85"]
    assert has_hardware.main(["--plan", "--mps", "70,85", "--rate", "7", "--requests", "40", "--trials", "6",
                              "--no-progress", "--save", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["pick"] == both["pick"]


# ------------------------------------------------------------------ --summary
def pt(rate: float, moderate: float, requests: int = 40) -> dict:
    return {"rate": rate, "requests": requests, "goodput": {"moderate": moderate, "strict": 0.0}, "throughput": rate}


def test_the_summary_compares_the_pick_with_the_best_of_the_sweep_and_the_top_3(tmp_path: Path) -> None:
    plan = {"rate": 3.5, "pick": "easerve:e1p1d1:b4:s0.5",
            "groups": {"has": ["easerve:e1p1d1:b4:s0.5", "easerve:e2p0d1:b2:s0", "easerve:e1p0d2:b4:s0"],
                       "baselines": ["dynamo-style:e1p1d1", "aggregated@1024", "aggregated@2048"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "has_hardware_h200_a.json").write_text(json.dumps({"host_gpus": 1, "systems": {
        "easerve:e1p1d1:b4:s0.5": {"points": [pt(3.5, 2.8)]},
        "easerve:e2p0d1:b2:s0": {"points": [pt(3.5, 2.9)]},
        "easerve:e1p0d2:b4:s0": {"points": [], "error": "TimeoutError: easerve serve not ready in 120 s"},
    }}))
    (tmp_path / "has_hardware_h200_b.json").write_text(json.dumps({"host_gpus": 1, "systems": {
        "dynamo-style:e1p1d1": {"points": [pt(3.5, 2.6)]},
        "aggregated@1024": {"points": [pt(3.5, 2.95)]},
    }}))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "has_hardware.py"), "--summary", "--plan-file",
                        str(tmp_path / "plan.json"), "--measured", str(tmp_path / "has_hardware_h200_*.json")],
                       capture_output=True, text=True, check=True, cwd=REPO)
    s = json.loads(r.stdout)
    v = s["rates"]["3.5"]
    assert v["pick_goodput"] == 2.8 and v["best"] == "aggregated@1024" and v["best_goodput"] == 2.95
    assert v["ratio"] == round(2.8 / 2.95, 4) and v["meets_bar"] is (2.8 / 2.95 >= 0.95)
    assert v["complete"] is False and v["not_measured"] == ["easerve:e1p0d2:b4:s0", "aggregated@2048"]
    assert set(v["systems"]) == {"easerve:e1p1d1:b4:s0.5", "easerve:e2p0d1:b2:s0", "dynamo-style:e1p1d1",
                                 "aggregated@1024"}
    assert v["systems"]["dynamo-style:e1p1d1"]["role"] == "dynamo-style"
    for name, row in v["systems"].items():  # beside each: the twin on that point's 40 requests, one host GPU
        assert row["twin"] == has_hardware.predict(name, 3.5, 40, tmp_path)["goodput"] > 0
    assert "not ready" in s["failed"]["easerve:e1p0d2:b4:s0"]


def test_the_summary_predicts_with_the_plans_own_profile(tmp_path: Path) -> None:
    """A plan made on the H100's profile: --summary's twin column is that profile's without being
    told, and an explicit --profile still wins."""
    h100 = "benchmarks/results/engine_profile_h100_llava7b_run20.json"
    plan = {"rate": 7.0, "pick": "easerve:e1p1d1:b1:s1+mps85", "profile": h100,
            "groups": {"has": ["easerve:e1p1d1:b1:s1+mps85"], "baselines": ["dynamo-style:e1p1d1+mps85"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "has_hardware_h100_a.json").write_text(json.dumps({"host_gpus": 1, "systems": {
        "easerve:e1p1d1:b1:s1+mps85": {"points": [pt(7.0, 6.7)]}, "dynamo-style:e1p1d1+mps85": {"points": [pt(7.0, 6.7)]}}}))

    def twin(*extra: str) -> float:
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "has_hardware.py"), "--summary", "--plan-file",
                            str(tmp_path / "plan.json"), "--measured", str(tmp_path / "has_hardware_h100_*.json"), *extra],
                           capture_output=True, text=True, check=True, cwd=REPO)
        return float(json.loads(r.stdout)["rates"]["7"]["systems"]["easerve:e1p1d1:b1:s1+mps85"]["twin"])

    plans_own, told_h100 = twin(), twin("--profile", h100)
    told_shipped = twin("--profile", str(has_hardware.PROFILES[0]))
    assert plans_own == told_h100 and plans_own != told_shipped


def test_the_pick_as_the_best_measured_meets_the_bar(tmp_path: Path) -> None:
    plan = {"rate": 2.0, "pick": "easerve:e1p1d1:b4:s0.5",
            "groups": {"has": ["easerve:e1p1d1:b4:s0.5"], "baselines": ["dynamo-style:e1p1d1"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    f = tmp_path / "has_hardware_h200_a.json"
    f.write_text(json.dumps({"host_gpus": 1, "systems": {
        "easerve:e1p1d1:b4:s0.5": {"points": [pt(2.0, 1.9)]}, "dynamo-style:e1p1d1": {"points": [pt(2.0, 1.5)]}}}))
    s = has_hardware.summary(tmp_path / "plan.json", [f])
    v = s["rates"]["2"]
    assert v["ratio"] == 1.0 and v["meets_bar"] is True and v["complete"] is True


def test_every_baseline_measured_at_the_rate_is_in_the_sweep(tmp_path: Path) -> None:
    """A Dynamo-style system measured under other SM caps than the plan names is a point of the
    baselines' sweep: the pick is held to it too, and the verdict says it was added."""
    plan = {"rate": 7.0, "pick": "easerve:e1p0d1:b7:s0+mps85",
            "groups": {"has": ["easerve:e1p0d1:b7:s0+mps85"], "baselines": ["dynamo-style:e1p1d1+mps85"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    f = tmp_path / "has_hardware_h200_a.json"
    f.write_text(json.dumps({"host_gpus": 1, "systems": {
        "easerve:e1p0d1:b7:s0+mps85": {"points": [pt(7.0, 5.0)]},
        "dynamo-style:e1p1d1+mps85": {"points": [pt(7.0, 3.0)]},
        "dynamo-style:e1p1d1+mps50": {"points": [pt(7.0, 6.0), pt(5.5, 9.0)]},
        "easerve:e1p1d1:b6:s0.5+mps70": {"points": [pt(7.0, 8.0)]},  # not a baseline, not in the plan
    }}))
    v = has_hardware.summary(tmp_path / "plan.json", [f])["rates"]["7"]
    assert v["sweep_extra"] == ["dynamo-style:e1p1d1+mps50"]
    assert v["best"] == "dynamo-style:e1p1d1+mps50" and v["ratio"] == round(5.0 / 6.0, 4)
    assert v["meets_bar"] is False and v["complete"] is True
    assert "easerve:e1p1d1:b6:s0.5+mps70" not in v["systems"]


def test_a_point_measured_twice_counts_as_the_mean_of_its_repeats(tmp_path: Path) -> None:
    for part, g in (("a", 2.0), ("b", 3.0)):
        (tmp_path / f"has_hardware_h200_{part}.json").write_text(json.dumps(
            {"systems": {"dynamo-style:e1p1d1": {"points": [pt(3.5, g) | {"ttft_p99": 2 * g}]}}}))
    p = has_hardware.measured_points(sorted(tmp_path.glob("*.json")))[("dynamo-style:e1p1d1", 3.5)]
    assert p["goodput"] == {"moderate": 2.5, "strict": 0.0} and p["ttft_p99"] == 5.0 and p["rate"] == 3.5
    assert [r["goodput_moderate"] for r in p["repeats"]] == [2.0, 3.0]
    assert p["file"] == "has_hardware_h200_a.json,has_hardware_h200_b.json"


def test_deploy_skips_what_is_measured_and_what_does_not_fit(tmp_path: Path) -> None:
    """No GPU: every system is either measured already or over the budget, so nothing starts."""
    plan = {"rate": 3.5, "pods": 3, "pick": "easerve:e1p1d1:b4:s0.5",
            "groups": {"has": ["easerve:e1p1d1:b4:s0.5", "easerve:e2p0d1:b2:s0"], "baselines": ["aggregated@1024"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "has_hardware_h200_a.json").write_text(json.dumps(
        {"systems": {"easerve:e1p1d1:b4:s0.5": {"points": [pt(3.5, 2.8)]}}}))
    out = tmp_path / "out"
    rc = has_hardware.main(["--deploy", "--plan-file", str(tmp_path / "plan.json"), "--out", str(out), "--group", "all",
                            "--measured", str(tmp_path / "has_hardware_h200_*.json"), "--budget-s", "100"])
    assert rc == 0
    rep = json.loads((out / "has_hardware_deploy.json").read_text())
    assert rep["ran"] == []
    assert [s["system"] for s in rep["skipped"]] == ["easerve:e2p0d1:b2:s0", "aggregated@1024"]
    assert rep["skipped"][0]["needs_s"] == round(has_hardware.system_cost_s([3.5], 300))
    assert json.loads((out / "gpu_serve.json").read_text())["has_hardware_plan"]["pick"] == plan["pick"]


def test_the_mps_fit_counts_a_repeated_point_once_as_the_mean_of_its_repeats(tmp_path: Path) -> None:
    """``twin_agreement.py --mps-fit`` on runs 14-15: a point measured twice (E1 P0 D1, B = 6 at
    85 % and 7 req/s: runs 14i and 15c) is one point, its figures the repeats' mean, and time-sliced
    systems (no ``+mps``) are not fitted."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    pts = ta.mps_points(results / "engine_profile_h200_llava7b_run12.json",
                        results / "engine_profile_h200_llava7b_cpu_preprocess_run12.json",
                        str(results / "gpu_serve_h200_run1[45]*_300req.json"), tmp_path)
    keys = [(system, p["rate"]) for system, _, p, _ in pts]
    assert len(keys) == len(set(keys)) and all("+mps" in s for s, _ in keys)
    p = next(p for system, _, p, _ in pts if (system, p["rate"]) == ("easerve:e1p0d1:b6:s0+mps85", 7.0))
    files = sorted(r["file"] for r in p["repeats"])
    assert files == ["gpu_serve_h200_run14i_300req.json", "gpu_serve_h200_run15c_300req.json"]
    raw = [json.loads((results / f).read_text())["systems"]["easerve:e1p0d1:b6:s0+mps85"]["points"] for f in files]
    goodputs = [q["goodput"]["moderate"] for pts_ in raw for q in pts_ if q["rate"] == 7.0]
    assert p["goodput"]["moderate"] == pytest.approx(sum(goodputs) / len(goodputs))


def test_the_encode_check_sets_the_twins_encoder_beside_the_encode_counters() -> None:
    """``twin_agreement.py --encode-check``: every capped point of run 17 whose encode counters
    survive the merge of repeats gets the twin's own ``encode_over_profile`` and requests per batch
    for the same requests, beside the GPU's."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    rep = ta.encode_check(results / "engine_profile_h200_llava7b.json",
                          results / "engine_profile_h200_llava7b_cpu_preprocess.json",
                          str(results / "gpu_serve_h200_run17*_300req.json"))
    pts = rep["points"]
    assert pts and all("+mps" in r["system"] for r in pts)
    for r in pts:
        assert r["encode_over_profile"]["gpu"] > 1.0 and r["encode_over_profile"]["twin"] > 1.0  # shared GPU
        assert r["requests_per_batch"]["twin"] >= 1.0
    assert rep["mean_abs_log_error_encode_over_profile"] >= 0.0


def test_the_h100_profile_carries_its_own_mps_constants_and_a_fit_writes_them(tmp_path: Path) -> None:
    """The H100's profile carries the MPS constants fitted on its runs 18-19 (``--mps-fit
    --write-profile``), which the twin then charges instead of the H200's; ``write_mps`` puts a
    fit's best point into a profile file as ``engine.mps`` and the file reads back with it."""
    import twin_agreement as ta
    from easerve_runtime.profiles.source import load_profile_file
    from easerve_runtime.sim import mpsshare

    results = REPO / "benchmarks" / "results"
    h100 = load_profile_file(results / "engine_profile_h100_llava7b_run20.json")
    assert h100.mps_constants is not None
    assert (h100.mps_constants["contention"], h100.mps_constants["decode_corun"]) != (
        mpsshare.CONTENTION, mpsshare.DECODE_CORUN)
    assert load_profile_file(results / "engine_profile_h200_llava7b_run12.json").mps_constants is None
    f = tmp_path / "p.json"
    f.write_text((results / "engine_profile_h200_llava7b_run12.json").read_text())
    fit = {"best": {"contention": 0.3, "decode_corun": 0.1, "decode_saturation": 0.25, "fit_error": 0.2},
           "in_code": {"fit_error": 0.4}}
    assert ta.write_mps(fit, [f, tmp_path / "absent.json"], "runs") == [str(f)]
    assert load_profile_file(f).mps_constants == {"contention": 0.3, "decode_corun": 0.1, "decode_saturation": 0.25,
                                                  "encode_corun": 0.0, "decode_row_ms": 0.0,
                                                  "decode_row_extra_ms": 0.0}  # not in the fit: the schema's defaults


def test_the_mps_fit_rides_each_grid_point_on_a_model_copy_and_leaves_the_module_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mps-fit`` passes each grid point to the twin on a copy of the stage model
    (``StageModel.mps_constants``) instead of setting ``sim.mpsshare``'s module constants: after a
    fit the module reads as before, two grid points far apart predict differently (the constants
    reach the twin although the H100's profile carries its own), and the starting point is the
    profile's ``engine.mps``."""
    import twin_agreement as ta
    from easerve_runtime.sim import mpsshare

    monkeypatch.setattr(ta, "MPS_GRID", {"contention": (0.0, 0.5), "decode_corun": (0.0,), "decode_saturation": (0.4,),
                                         "encode_corun": (0.0,), "decode_contention": (0.0,)})
    before = (mpsshare.CONTENTION, mpsshare.DECODE_CORUN, mpsshare.DECODE_SATURATION)
    results = REPO / "benchmarks" / "results"
    fit = ta.mps_fit(results / "engine_profile_h100_llava7b_run20.json",
                     results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json",
                     str(results / "gpu_serve_h100_run19a_300req.json"))
    assert before == (mpsshare.CONTENTION, mpsshare.DECODE_CORUN, mpsshare.DECODE_SATURATION)
    assert fit["in_code"]["from"] == "the profile's engine.mps"
    errors = [g["fit_error"] for g in fit["grid"]]
    assert len(errors) == 2 and errors[0] != errors[1]
    assert fit["best"]["fit_error"] == min(errors)


def test_the_mps_fit_can_score_each_stage_against_the_workers_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mps-fit --fit-stages`` on run 34b (E1 P1 D1 B 1 s 1 under a 70 % cap, 7 req/s, one H100):
    each point's error also holds the encoder's and the prefill's time over its profile against
    what the workers' counters read on the GPU, so the score changes; without it the error holds
    the three end-to-end figures only. At the profile's constants the twin charges this encoder
    more than its counters read (2.98 against 1.81 in run 34's notes), the trade the flag is for."""
    import twin_agreement as ta

    monkeypatch.setattr(ta, "MPS_GRID", {"contention": (0.05, 0.3), "decode_corun": (0.0,), "decode_saturation": (0.05,),
                                         "encode_corun": (0.9,), "decode_contention": (0.0,)})
    results = REPO / "benchmarks" / "results"
    run = results / "gpu_serve_h100_run34b_300req.json"
    point = json.loads(run.read_text())["systems"]["easerve:e1p1d1:b1:s1+mps70"]["points"][0]
    assert ta.gpu_stage_ratios(point) == {"encode": point["encode"]["engine_over_profile"],
                                          "prefill": point["prefill"]["prefill"]["engine_over_profile"]}
    args = (results / "engine_profile_h100_llava7b_run20.json",
            results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json", str(run))
    plain, staged = ta.mps_fit(*args), ta.mps_fit(*args, stages=True)
    assert set(plain["points"][0]["abs_log_error"]) == {"goodput_moderate", "tpot_p50", "ttft_p99"}
    row = staged["points"][0]
    assert set(row["abs_log_error"]) == {"goodput_moderate", "tpot_p50", "ttft_p99",
                                         "encode_over_profile", "prefill_over_profile"}
    assert row["stage_over_profile"]["encode"]["gpu"] == round(point["encode"]["engine_over_profile"], 3)
    assert row["stage_over_profile"]["encode"]["twin"] > row["stage_over_profile"]["encode"]["gpu"]
    assert staged["fit_stages"] and not plain["fit_stages"]
    assert [g["fit_error"] for g in staged["grid"]] != [g["fit_error"] for g in plain["grid"]]


def test_the_mps_fit_can_fit_up_to_a_higher_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fit-max-rate``: run 35a served three layouts at 8.5 req/s only (one H100). Up to the
    default 7 req/s every point is held out and the fit scores nothing; up to 8.5 each is a fit
    point, so the fit's error reads those points, where TPOT is near the moderate tier's bound and
    decides goodput, and the two grid points rank apart. The result names the rate it fitted up to."""
    import twin_agreement as ta

    monkeypatch.setattr(ta, "MPS_GRID", {"contention": (0.1, 0.3), "decode_corun": (0.0,), "decode_saturation": (0.05,),
                                         "encode_corun": (0.9,), "decode_contention": (0.0,)})
    results = REPO / "benchmarks" / "results"
    args = (results / "engine_profile_h100_llava7b_run20.json",
            results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json",
            str(results / "gpu_serve_h100_run35a_300req.json"))
    low, high = ta.mps_fit(*args), ta.mps_fit(*args, max_rate=8.5)
    assert {r["rate"] for r in low["points"]} == {8.5}
    assert all(r["held_out"] for r in low["points"]) and all(g["fit_error"] == 0 for g in low["grid"])
    assert not any(r["held_out"] for r in high["points"]) and len(high["points"]) == 3
    assert (low["fit_rates_up_to"], high["fit_rates_up_to"]) == (ta.MPS_FIT_MAX_RATE, 8.5)
    errors = [g["fit_error"] for g in high["grid"]]
    assert min(errors) > 0 and errors[0] != errors[1]
    assert [g["fit_error"] for g in high["grid"]] == [g["held_out_error"] for g in low["grid"]]


def test_the_mps_fit_can_run_each_point_behind_the_door_it_was_served_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mps-fit --fit-door``: each point's twin runs behind its frontend's door, sized as the run's
    pods sized it. Run 34c and 34d served the same two systems at 10 req/s, the pods reading the H100's
    and the H200's profile: with the door they are four points at two door sizes, not two means of
    repeats. Run 34e (the pick at 11 and 12 req/s, past saturation): with the door open the twin
    queues every request and its P99 TTFT reads over twice the GPU's; behind the door it refuses
    requests as the frontend did, and reads nearer the GPU's at both rates."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    profile = results / "engine_profile_h100_llava7b_run20.json"
    cpu_pre = results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json"
    cd = f"{results}/gpu_serve_h100_run34c_300req.json,{results}/gpu_serve_h100_run34d_300req.json"
    with tempfile.TemporaryDirectory() as t:
        open_ = ta.mps_points(profile, cpu_pre, cd, Path(t))
        door = ta.mps_points(profile, cpu_pre, cd, Path(t), door=True)
    assert [len(p["repeats"]) for _, _, p, _ in open_] == [2, 2] and all("door_rps" not in p for _, _, p, _ in open_)
    assert len(door) == 4
    for system in {s for s, _, _, _ in door}:
        sizes = sorted(p["door_rps"] for s, _, p, _ in door if s == system)
        assert len(sizes) == 2 and 0 < sizes[0] < sizes[1]

    monkeypatch.setattr(ta, "MPS_GRID", {"contention": (0.2,), "decode_corun": (0.0,), "decode_saturation": (0.05,),
                                         "encode_corun": (0.9,), "decode_contention": (0.0,)})
    e = str(results / "gpu_serve_h100_run34e_300req.json")
    plain, behind = ta.mps_fit(profile, cpu_pre, e), ta.mps_fit(profile, cpu_pre, e, door=True)
    assert behind["fit_door"] and not plain["fit_door"]
    for o, d in zip(plain["points"], behind["points"], strict=True):
        gpu = o["measured"]["ttft_p99"]
        assert o["twin"]["ttft_p99"] > 2 * gpu
        assert abs(d["twin"]["ttft_p99"] / gpu - 1) < abs(o["twin"]["ttft_p99"] / gpu - 1)
        assert (d["twin"]["failed"] or 0) > 0  # behind the door the twin refuses, as the frontend did
        assert (o["twin"]["failed"] or 0) == 0  # with it open, nothing is refused


def test_the_loop_calibration_reads_both_per_row_terms_off_the_decode_counters(tmp_path: Path) -> None:
    """``twin_agreement.py --calibrate-loop`` on runs 25-26 (two H100 hosts): the GPU's per-row term is
    the capped points' engine step over the profile's at the same rows, through the origin; the
    host's is each run's loop iteration over its step beyond the zero-load overhead, per row.
    Written into a copy of the profile, both read back into the twin's stage model, and the twin's
    prediction of a run charges that run's own host (``--host-loop run``) or the profile's."""
    import twin_agreement as ta
    from easerve_runtime.api import parse_spec
    from easerve_runtime.profiles.source import load_profile_file
    from easerve_runtime.sim.systems import model_for

    results = REPO / "benchmarks" / "results"
    src = results / "engine_profile_h100_llava7b_run20.json"
    prof, cpu = tmp_path / "p.json", tmp_path / "pc.json"
    prof.write_text(src.read_text())
    cpu.write_text((results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json").read_text())
    runs = str(results / "gpu_serve_h100_run2[56]*_300req.json")
    cal = ta.calibrate_loop(runs, prof, cpu, write=True)
    pts = cal["points"]
    assert pts and all("+mps" in p["system"] for p in pts)
    # excess = rows x (decode_row_ms + decode_row_extra_ms x the prefilling pods beyond the first),
    # least squares through the origin: the residuals are orthogonal to both regressors
    a, b = cal["decode_row_ms"], cal["decode_row_extra_ms"]
    res = [p["excess_ms"] - p["rows"] * (a + b * p["extra_prefill_pods"]) for p in pts]
    assert sum(p["rows"] * e for p, e in zip(pts, res, strict=True)) == pytest.approx(0, abs=0.05 * len(pts))
    assert sum(p["rows"] * p["extra_prefill_pods"] * e for p, e in zip(pts, res, strict=True)) == pytest.approx(0, abs=0.05 * len(pts))
    assert a > 0 and b > 0  # two prefilling pods (E2 P0 D1, E1 P1 D1 at s 0.5) cost decode more a row
    two = {p["system"] for p in pts if p["extra_prefill_pods"] == 1}
    assert two and all(s.startswith("easerve:e2p0d1") or ":s0.5" in s for s in two)
    assert all(p["extra_prefill_pods"] == 0 for p in pts if p["system"].startswith(("dynamo-style", "easerve:e1p0d1")))
    assert all(p["engine_step_ms"] > p["profile_step_ms"] for p in pts)  # beside capped pods, slower than alone
    by_run = cal["decode_loop_row_ms_by_run"]
    assert set(by_run) == {"gpu_serve_h100_run25a_300req.json", "gpu_serve_h100_run25b_300req.json",
                           "gpu_serve_h100_run25c_300req.json", "gpu_serve_h100_run26a_300req.json"}
    run = json.loads((results / "gpu_serve_h100_run25b_300req.json").read_text())
    xs = [(p["decode_loop"]["rows_per_step"], p["decode_loop"]["loop_iteration_ms"] - p["decode_loop"]["engine_step_ms"] - 0.66)
          for sy in run["systems"].values() for p in sy["points"]]
    assert by_run["gpu_serve_h100_run25b_300req.json"] == pytest.approx(
        sum(x * y for x, y in xs) / sum(x * x for x, _ in xs), abs=1e-4)
    assert cal["decode_loop_row_ms"] == pytest.approx(sum(by_run.values()) / len(by_run), abs=1e-4)
    for f in (prof, cpu):  # both files carry both terms, and they reach the twin
        loaded = load_profile_file(f)
        assert loaded.decode_row_overhead_s == pytest.approx(cal["decode_loop_row_ms"] / 1e3)
        assert loaded.mps_constants is not None and loaded.mps_constants["decode_row_ms"] == cal["decode_row_ms"]
    with tempfile.TemporaryDirectory() as t:
        system = "easerve:e1p0d1:b1:s0+mps85"
        spec = parse_spec(ta.twin_spec(run["systems"]["dynamo-style:e1p1d1+mps85"]["spec"],
                                       ta.system_profile("dynamo-style:e1p1d1+mps85", Path(t), prof, cpu)))
        assert model_for(spec).decode_row_overhead_s == pytest.approx(cal["decode_loop_row_ms"] / 1e3)
        one = json.loads((results / "gpu_serve_h100_run25c_300req.json").read_text())
        slow = json.loads(prof.read_text())
        slow["engine"]["decode_loop_row_ms"] = 0.3  # a slower host's (runs 18-24 read 0.20-0.27)
        prof.write_text(json.dumps(slow))
        own = ta.predict(one, Path(t), prof, cpu, host_loop="run")
        profiles_ = ta.predict(one, Path(t), prof, cpu, host_loop="profile")
    assert own[system]["decode_loop_row_ms"] == pytest.approx(by_run["gpu_serve_h100_run25c_300req.json"], abs=1e-4)
    assert profiles_[system]["decode_loop_row_ms"] is None and own["aggregated@2048"]["decode_loop_row_ms"] is None
    # a card without constants of its own (the H200's profile) gets the module's beside the new term,
    # and the file stays a valid profile
    h200 = tmp_path / "h200.json"
    h200.write_text((results / "engine_profile_h200_llava7b_run12.json").read_text())
    c2 = ta.calibrate_loop(runs, h200, None, write=True)
    from easerve_runtime.sim import mpsshare

    assert load_profile_file(h200).mps_constants == {**mpsshare.DEFAULTS, "decode_row_ms": c2["decode_row_ms"],
                                                     "decode_row_extra_ms": c2["decode_row_extra_ms"]}
    # this host's loop is cheaper than the profile's: its decode is predicted faster
    tpot = [r[system]["points"][-1]["twin"]["tpot_p50"] for r in (own, profiles_)]
    assert tpot[0] < tpot[1]


@pytest.mark.parametrize("terms", ["gpu", "host"])
def test_the_loop_calibration_writes_each_term_on_its_own(tmp_path: Path, terms: str) -> None:
    """``--calibrate-loop --loop-terms gpu|host --write-profile``: the GPU's per-row step terms and
    the host's loop term come from different runs (the loop term changed with the IPC handoff), so
    either is written alone, and the other keeps the file's value."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    prof = tmp_path / "p.json"
    prof.write_text((results / "engine_profile_h100_llava7b_run20.json").read_text())
    before = json.loads(prof.read_text())["engine"]
    cal = ta.calibrate_loop(str(results / "gpu_serve_h100_run2[56]*_300req.json"), prof, None, write=True, terms=terms)
    after = json.loads(prof.read_text())["engine"]
    assert cal["terms_written"] == terms
    gpu = {k: after["mps"][k] for k in ("decode_row_ms", "decode_row_extra_ms")}
    if terms == "gpu":
        assert gpu == {k: cal[k] for k in gpu} and gpu != {k: before["mps"][k] for k in gpu}
        assert after["decode_loop_row_ms"] == before["decode_loop_row_ms"] != cal["decode_loop_row_ms"]
    else:
        assert after["decode_loop_row_ms"] == cal["decode_loop_row_ms"] != before["decode_loop_row_ms"]
        assert after["mps"] == before["mps"]
    with pytest.raises(ValueError, match="terms"):
        ta.calibrate_loop(str(results / "gpu_serve_h100_run25a_300req.json"), prof, None, write=True, terms="both")


def test_the_kv_handoff_is_read_off_both_sides_counters_and_becomes_the_links_kv_setup(tmp_path: Path) -> None:
    """``twin_agreement.py --calibrate-kv`` on run 27b (the first run that counted both sides): each
    point's handoff is the prefill's copy out plus the decode's take and stage, less half an engine
    step; the mean goes into the profile's link as ``kv_setup_ms``, and the twin's KV transfer then
    costs that much more, while an embedding transfer does not change."""
    import twin_agreement as ta
    from easerve_runtime.profiles.source import load_profile_file

    results = REPO / "benchmarks" / "results"
    run = json.loads((results / "gpu_serve_h100_run27b_300req.json").read_text())
    kv = ta.kv_handoff_ms(str(results / "gpu_serve_h100_run27b_300req.json"))
    expect = [p["prefill"]["kv-handoff"]["ms_mean"] + p["decode_loop"]["handoff_ms"] - p["decode_loop"]["engine_step_ms"] / 2
              for sy in run["systems"].values() for p in sy["points"]]
    assert [r["kv_handoff_ms"] for r in kv["points"]] == pytest.approx(expect, abs=0.01)
    assert kv["kv_handoff_ms"] == pytest.approx(sum(expect) / len(expect), abs=0.05)
    # runs before 27 counted only the decode side (or nothing): no handoff is read off them
    assert ta.kv_handoff_ms(str(results / "gpu_serve_h100_run25b_300req.json"))["kv_handoff_ms"] is None
    f = tmp_path / "p.json"
    doc = json.loads((results / "engine_profile_h100_llava7b_run20.json").read_text())
    doc.pop("links", None)  # the shipped link's setup, as before the calibration
    f.write_text(json.dumps(doc))
    before = load_profile_file(f)
    out = ta.calibrate_kv(str(results / "gpu_serve_h100_run27b_300req.json"), f, tmp_path / "absent.json", write=True)
    assert out["written"] == [str(f)]
    after = load_profile_file(f)
    nbytes = before.kv_bytes(2500)
    assert after.transfer_s(nbytes, path="kv") - before.transfer_s(nbytes, path="kv") == pytest.approx(
        (kv["kv_handoff_ms"] - 0.3) / 1e3, rel=1e-3)  # the link's 0.3 ms setup became the handoff's
    assert after.transfer_s(10_000, path="embedding") == pytest.approx(before.transfer_s(10_000, path="embedding"))


def test_each_kv_path_is_calibrated_from_the_points_that_served_it(tmp_path: Path) -> None:
    """Run 28 served the same layouts with the KV handoff by CUDA IPC (``+kvipc``: decode opened
    shares) and through the host: each path's mean below saturation (``max_rate``) becomes its own
    setup in the profile's link, ``kv_ipc_setup_ms`` and ``kv_setup_ms``."""
    import twin_agreement as ta
    from easerve_runtime.profiles.source import load_profile_file

    results = REPO / "benchmarks" / "results"
    name = str(results / "gpu_serve_h100_run28_300req.json")
    kv = ta.kv_handoff_ms(name, max_rate=7.0)
    by = {p: [r["kv_handoff_ms"] for r in kv["points"] if r["path"] == p] for p in ("host", "kv_ipc")}
    assert all(r["rate"] <= 7.0 for r in kv["points"]) and by["host"] and by["kv_ipc"]
    assert all(("+kvipc" in r["system"]) == (r["path"] == "kv_ipc") for r in kv["points"])
    assert kv["kv_ipc_handoff_ms"] == pytest.approx(sum(by["kv_ipc"]) / len(by["kv_ipc"]), abs=0.05)
    assert kv["kv_handoff_ms"] == pytest.approx(sum(by["host"]) / len(by["host"]), abs=0.05)
    assert max(by["kv_ipc"]) < min(by["host"])
    f = tmp_path / "p.json"
    f.write_text((results / "engine_profile_h100_llava7b_run20.json").read_text())
    ta.calibrate_kv(name, f, None, write=True, max_rate=7.0)
    link = load_profile_file(f).hw.link
    assert (link.kv_setup_s, link.kv_ipc_setup_s) == pytest.approx((kv["kv_handoff_ms"] / 1e3,
                                                                   kv["kv_ipc_handoff_ms"] / 1e3))


def test_the_aggregated_calibration_reads_the_loops_counters_and_the_twin_then_matches_them(tmp_path: Path) -> None:
    """``twin_agreement.py --calibrate-aggregated`` on run 22c (the aggregated loop served at 0.5
    req/s on an H100): the ratios are the loop's own encode and prefill seconds over the twin's for
    the same 40 requests; written into a copy of the H100 profile, the twin's aggregated replica then
    charges what the loop measured, and a second calibration starts from the written ratios
    without compounding them."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    prof = tmp_path / "profile.json"
    doc = json.loads((results / "engine_profile_h100_llava7b_run20.json").read_text())
    doc["engine"].pop("aggregated", None)
    prof.write_text(json.dumps(doc))
    runs = str(results / "gpu_serve_h100_run22c_40req.json")
    first = ta.calibrate_aggregated(runs, prof, write=True)
    (row,) = first["points"]
    assert row["system"] == "aggregated@2048" and row["rate"] == 0.5 and row["requests"] == 40
    assert row["encode_over_profile"] == pytest.approx(row["gpu"]["encode_s"] / row["twin"]["encode_s"], rel=1e-2)
    assert row["encode_over_profile"] > 1.0 and row["prefill_over_profile"] > 1.0  # the loop pays more than the points
    assert json.loads(prof.read_text())["engine"]["aggregated"]["prefill_over_profile"] == first["ratios"]["prefill_over_profile"]
    from easerve_runtime.api import parse_spec
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    served = json.loads((results / "gpu_serve_h100_run22c_40req.json").read_text())["systems"]["aggregated@2048"]
    spec = parse_spec(ta.twin_spec(served["spec"], ta.merged_profile(tmp_path, prof, None)))
    agg = spec.aggregated_engine
    res = simulate_system(spec, generate(spec, 0.5, 40, ta.BENCH_SEED), "aggregated",
                          layout=(agg.tensor_parallel, 1, agg.token_budget))
    assert res.stats["encode_s"] == pytest.approx(row["gpu"]["encode_s"], rel=0.02)
    assert res.stats["prefill_s"] == pytest.approx(row["gpu"]["prefill_s"], rel=0.02)
    again = ta.calibrate_aggregated(runs, prof)
    assert again["profile_had"]["encode_over_profile"] == first["ratios"]["encode_over_profile"]
    assert again["ratios"] == first["ratios"]


def test_a_cpu_preprocessing_systems_profile_carries_the_hosts_part_of_each_encode(tmp_path: Path) -> None:
    """``system_profile`` gives a system that preprocesses on the CPU the CPU run's encode points and,
    as ``engine.encode_host``, what each takes beyond the GPU run's encode at the same items (linear
    between its points): the part during which the encoder holds no GPU. A GPU-preprocessing system's
    profile has none."""
    import twin_agreement as ta
    from easerve_runtime.profiles import load_profile_file

    results = REPO / "benchmarks" / "results"
    prof = results / "engine_profile_h100_llava7b_run20.json"
    cpu = ta.cpu_preprocess_of(prof)
    on_gpu, on_cpu = (json.loads(f.read_text())["engine"]["encode"] for f in (prof, cpu))
    merged = json.loads(ta.system_profile("dynamo-style:e1p1d1+mps85", tmp_path, prof, cpu).read_text())["engine"]
    assert merged["encode"] == on_cpu
    gpu_at = {p["items"]: p["ms"] for p in on_gpu}
    host = {p["items"]: p["ms"] for p in merged["encode_host"]}
    assert set(host) == {p["items"] for p in on_cpu if p["ms"] > gpu_at[p["items"]]} and host
    for p in on_cpu:
        assert host[p["items"]] == pytest.approx(p["ms"] - gpu_at[p["items"]], abs=1e-3)
    assert ta.encode_host_points([{"items": 2, "ms": 10.0}, {"items": 6, "ms": 20.0}],
                                 [{"items": 4, "ms": 18.0}, {"items": 12, "ms": 30.0}, {"items": 1, "ms": 4.0}]) == [
        {"items": 4, "ms": 3.0}]  # 15 between the GPU run's points; 35 and 7.5 beyond them, the end segments continued
    loaded = load_profile_file(tmp_path / "profile-cpu.json")
    assert 0 < loaded.encode_host_share(4) < 1
    gpu_only = json.loads(ta.system_profile("easerve:e1p1d1:b1:s1+mps85", tmp_path, prof, cpu).read_text())["engine"]
    assert "encode_host" not in gpu_only and load_profile_file(tmp_path / "profile-gpu.json").encode_host_share(4) == 0.0


def test_the_twins_door_sizes_from_the_profile_the_runs_pods_read(tmp_path: Path) -> None:
    """An H100 run up to run 32 was served with the H200 profile (``gpu_serve.py``'s default then),
    and its frontend sized the admission queue from that profile's capacity: 20 places for the pick
    and 18 for Dynamo-style, where the H100 profile the twin times it with gives 22 and 20. The
    twin's door takes the served profile's capacity; a run that records its served profile
    (``served_profile``, run 33 on) is taken at its word."""
    import math

    import twin_agreement as ta
    from easerve_runtime.profiles.capacity import saturation_rps

    results = REPO / "benchmarks" / "results"
    run = json.loads((results / "gpu_serve_h100_run31a_300req.json").read_text())
    h100 = results / "engine_profile_h100_llava7b_run20.json"
    bounds = {}
    for system, served in run["systems"].items():
        door = ta.served_door_capacity(run, system, served["spec"], tmp_path)
        own = saturation_rps(parse_spec(ta.twin_spec(
            served["spec"], ta.system_profile(system, tmp_path, h100, ta.cpu_preprocess_of(h100)))), host_gpus=1)
        bounds[system] = (math.ceil(3 * door), math.ceil(3 * own))
        recorded = ta.served_door_capacity({**run, "served_profile": h100.name}, system, served["spec"], tmp_path)
        assert recorded == pytest.approx(own)
    assert bounds == {"dynamo-style:e1p1d1+mps85": (18, 20), "easerve:e1p1d1:b1:s1+mps85": (20, 22)}


def test_the_old_fillers_token_count_is_what_the_tokenizer_made_of_it() -> None:
    """Runs up to 32 sent their prompts made of ``"lorem "``, which the BPE that ``easerve model
    init`` trains splits into 5 tokens a word: the twin replays them at that length
    (``legacy_prompt_tokens``), every count from 1 to 700 exactly as the tokenizer reads the old text;
    a run that records ``served_profile`` (run 33 on) or ``prompt_filler`` is replayed at the
    workload's own lengths."""
    import twin_agreement as ta
    from easerve_runtime.bench.payloads import PROMPT_FILLER
    from easerve_runtime.models.init import train_tokenizer
    from easerve_runtime.workload import generate

    tok = train_tokenizer("llava-next")
    for n in range(1, 701):
        old = (ta.LEGACY_FILLER * (4 * n // 6 + 1))[: 4 * n]
        assert ta.legacy_prompt_tokens(n) == len(tok(old)["input_ids"]), n
    assert ta.legacy_prompt_tokens(128) == 427
    results = REPO / "benchmarks" / "results"
    old_run = json.loads((results / "gpu_serve_h100_run31a_300req.json").read_text())
    new_run = json.loads((results / "gpu_serve_h100_run33a_300req.json").read_text())
    assert ta.prompt_filler_of(old_run) == ta.LEGACY_FILLER and ta.prompt_filler_of(new_run) == PROMPT_FILLER
    spec = parse_spec(ta.twin_spec(new_run["systems"]["easerve:e1p1d1:b1:s1+mps85"]["spec"],
                                   results / "engine_profile_h100_llava7b_run20.json"))
    reqs = generate(spec, 7.0, 50, ta.BENCH_SEED)
    assert ta.served_requests(reqs, PROMPT_FILLER) is reqs
    replayed = ta.served_requests(reqs, ta.LEGACY_FILLER)
    assert [r.prompt_tokens for r in replayed] == [ta.legacy_prompt_tokens(r.prompt_tokens) for r in reqs]
    assert [(r.media_tokens, r.output_tokens, r.arrival_s) for r in replayed] == [
        (r.media_tokens, r.output_tokens, r.arrival_s) for r in reqs]
    with pytest.raises(ValueError, match="prompt_filler"):
        ta.served_requests(reqs, "ipsum ")


def test_a_report_replays_old_runs_at_their_served_lengths_unless_told_the_workloads() -> None:
    """``--lengths served`` (the default) replays run 31 with its longer prompts, and so predicts it
    otherwise than ``--lengths workload`` (how reports before 2026-12-07 ran); run 33, sent at the
    workload's lengths, reads the same either way."""
    import twin_agreement as ta

    results = REPO / "benchmarks" / "results"
    prof, cpu = results / "engine_profile_h100_llava7b_run20.json", results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json"

    def twin(run: str, lengths: str) -> list[dict[str, float]]:
        rep = ta.report(prof, cpu, str(results / run), lengths=lengths)
        assert rep["lengths"] == lengths
        return [p["twin"] for s in rep["runs"][0]["systems"].values() for p in s["points"]]

    assert twin("gpu_serve_h100_run31a_300req.json", "served") != twin("gpu_serve_h100_run31a_300req.json", "workload")
    assert twin("gpu_serve_h100_run33c_300req.json", "served") == twin("gpu_serve_h100_run33c_300req.json", "workload")


def test_a_report_sets_the_twins_decode_rows_and_iteration_beside_the_gpus() -> None:
    """TPOT is made of the requests a decode step carries and the time a loop iteration takes; the
    report reads both off the GPU's loop counters and off the twin's decode workers, so a TPOT miss
    says which it is. The twin's iteration is its decode workers' busy time over their steps, and
    its rows the tokens it decoded over those steps."""
    import twin_agreement as ta
    from easerve_runtime.api import parse_spec
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    results = REPO / "benchmarks" / "results"
    prof, cpu = results / "engine_profile_h100_llava7b_run20.json", results / "engine_profile_h100_llava7b_cpu_preprocess_run20.json"
    name = "gpu_serve_h100_run34b_300req.json"
    run = json.loads((results / name).read_text())
    rep = ta.report(prof, cpu, str(results / name))
    (system, s), = rep["runs"][0]["systems"].items()
    (p,), (gp,) = s["points"], run["systems"][system]["points"]
    assert p["measured"]["decode_rows"] == gp["decode_loop"]["rows_per_step"]
    assert p["measured"]["decode_iteration_ms"] == gp["decode_loop"]["loop_iteration_ms"]
    assert p["twin"]["decode_rows"] > 1 and p["twin"]["decode_iteration_ms"] > 0

    with tempfile.TemporaryDirectory() as t:
        spec = parse_spec(ta.twin_spec(run["systems"][system]["spec"], ta.system_profile(system, Path(t), prof, cpu)))
        res = simulate_system(spec, generate(spec, 7.0, 120, ta.BENCH_SEED), "easerve", host_gpus=1,
                              mps_caps=ta.mps_caps_of(system))
    st = res.stats
    horizon = max(r.finish_s or 0.0 for r in res.records) - min(r.arrival_s for r in res.records)
    busy_s = (res.utilisation["decode"] or 0.0) * horizon  # one decode worker
    assert st["decode_ms_per_step"] * st["decode_steps"] / 1e3 == pytest.approx(busy_s, rel=1e-9)
    assert st["mean_decode_batch"] * st["decode_steps"] == pytest.approx(st["decoded_tokens"])
    assert ta.decode_rows(st) == {"decode_rows": round(st["mean_decode_batch"], 2),
                                  "decode_iteration_ms": round(st["decode_ms_per_step"], 2)}
