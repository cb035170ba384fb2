"""The twin, fed a profile measured on the engine, against the GPU runs it should predict (issue 17).

Two halves:

- ``--measure --out DIR`` (on the GPU machine): ``easerve profile --engine torch`` of the
  LLaVA-NeXT 7B that ``gpu_serve.py`` serves (the same model directory recipe and the same spec),
  on the JPEGs the bench sends (``--image-format jpeg``), once as served by EAServe (nvJPEG +
  processor on the GPU) and once, encode only, with the
  Dynamo-style CPU preprocessing (``spec.encode.preprocessing: cpu``). Writes ``engine_profile.json`` and
  ``engine_profile_cpu_preprocess.json`` into DIR.
- ``--measure-path --out DIR`` (on the GPU machine): both systems served by ``gpu_serve.py`` at
  next to no load (0.5 req/s, 40 requests): ``DIR/zero_load.json``. Then, anywhere,
  ``--calibrate-path benchmarks/results/twin_path_zero_load_h200.json`` writes each profile's
  ``request_path_ms``: the served TTFT p50 there minus the twin's on the same requests (engines
  alone). This is the serving path outside the engines (HTTP, parsing, request-plane hops,
  embedding bytes over the wire), which ``easerve profile`` cannot see from one process. It is
  measured on runs of its own, not on the runs the report predicts.
- default (anywhere, no GPU): for every point of the committed GPU runs
  (``benchmarks/results/gpu_serve_h200_*.json``), the twin runs that point's spec (its system's
  allocation, B, s and SM mode) on the same requests (``workload.generate`` with the bench's rate,
  count and seed) with ``spec.engine.profileFile`` = the measured profile, and the report sets its
  throughput and P99 TTFT beside the measured ones, as predicted / measured.

The bar (issue 17, item 4): throughput within 5 %, P99 TTFT within 15 %, at every rate up to 90 % of
saturation. Saturation is taken as the highest throughput the run measured for that system (a
run of one rate leaves it unknown: ``in_scope`` is null there).

    # GPU machine (torch + transformers; pydantic from .devsite, see benchmarks/make_devsite.sh)
    bash benchmarks/devsite.sh && PYTHONPATH=.devsite/site:runtime:operator \\
        python3 benchmarks/twin_agreement.py --measure --out $OUT
    # anywhere
    python benchmarks/twin_agreement.py            # JSON on stdout, docs/img/twin_agreement.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from easerve_runtime.profiles.measured import MPS_CONSTANTS

if TYPE_CHECKING:
    from easerve_runtime.api import EPDDeploymentSpec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROFILE = RESULTS / "engine_profile_h200_llava7b.json"
PROFILE_CPU_PRE = RESULTS / "engine_profile_h200_llava7b_cpu_preprocess.json"
ZERO_LOAD = RESULTS / "twin_path_zero_load_h200.json"
"""The zero-load runs the request path is measured from (not a run the report predicts)."""
ZERO_LOAD_RATE, ZERO_LOAD_REQUESTS = 0.5, 40
SERVED_BEFORE_RUN33 = RESULTS / "engine_profile_h200_llava7b_run12.json"
"""The profile ``gpu_serve.py`` served every run with from run 12 to run 32, H100 runs included (its
``--profile-file`` default; run 11 served ``..._run11.json``, and no run-11 file that names a profile
file is committed); runs since record theirs (``served_profile``)."""
BENCH_SEED = 1  # gpu_serve.bench_point's seed for every recorded point
LEGACY_FILLER = "lorem "
"""The bench's prompt filler up to run 32 (``bench.payloads.PROMPT_FILLER`` since): the local BPE
splits it into 5 tokens per word, so a workload prompt of N tokens reached the engine as
``legacy_prompt_tokens(N)`` (128 -> 427)."""
BAR = {"throughput": 0.05, "ttft_p99": 0.15, "up_to_saturation": 0.9}

sys.path.insert(0, str(REPO / "benchmarks"))


def run_files(globs: str) -> list[str]:
    """The result files that ``globs`` (comma-separated glob patterns) match, sorted, each once.
    Why several: one glob cannot pick run 18's parts c-d (after the H100 KV fix) and all of run 19."""
    return sorted({f for g in globs.split(",") if g for f in glob.glob(g)})


def card_names(names: Any) -> str:
    """GPU names as torch or nvidia-smi give them (``NVIDIA H100 80GB HBM3``), short and joined, for titles."""
    return " / ".join(sorted({str(n).replace("NVIDIA ", "") for n in names if n})) or "GPU"


def cards(runs_glob: str) -> str:
    """The GPUs the runs name (``gpu`` of each result file), for plot titles."""
    return card_names(json.loads(Path(f).read_text()).get("gpu") for f in run_files(runs_glob))


def log(msg: str) -> None:
    print(f"[twin_agreement {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the GPU half
def measure(out: Path, size: str, requests: int) -> int:
    import gpu_serve

    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="twin-agreement-"))
    model = gpu_serve.model_dir(work, size)
    env = {**os.environ, "EASERVE_TORCH_MAX_LEN": "4096"}
    if size == "tiny":
        env.update(EASERVE_DEVICE="cpu")
    small = size == "tiny"
    runs = (
        ("easerve", "engine_profile.json", "encode,prefill,decode"),
        ("dynamo-style", "engine_profile_cpu_preprocess.json", "encode"),
    )
    for system, name, stages in runs:
        doc = gpu_serve.spec_doc(system, model, 4.0, 0.45)
        spec = work / f"{system}.json"
        spec.write_text(json.dumps(doc))
        cmd = [sys.executable, "-m", "easerve_operator.cli", "profile", "--engine", "torch", "-f", str(spec),
               "-o", str(out / name), "--stages", stages, "--requests", "4" if small else str(requests),
               "--encode-batches", "1,4" if small else "1,2,4,8,16",
               "--decode-batches", "1,4" if small else "1,4,16,32,64", "--reps", "2" if small else "3", "--image-format", "jpeg"]
        log(f"{system}: {' '.join(cmd[3:])}")
        r = subprocess.run(cmd, env={**env, **gpu_serve.SYSTEMS[system]["env"]}, capture_output=True, text=True)
        (out / f"{name}.log").write_text(r.stderr[-20000:])
        if r.returncode != 0:
            log(f"{system}: easerve profile failed ({r.returncode}): {r.stderr[-3000:]}")
            return r.returncode
        print(r.stdout.strip().splitlines()[-1], flush=True)
    return 0


def measure_path(out: Path, size: str, profile: Path) -> int:
    """Both systems served at next to no load (``ZERO_LOAD_RATE``) with ``profile`` (the spec's
    latency profile, as the deploy serves them): what their first tokens take beyond the engines
    is the request path (``--calibrate-path`` turns it into the profile's term)."""
    work = Path(tempfile.mkdtemp(prefix="twin-path-"))
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_serve.py"), "--out", str(work), "--systems",
           "easerve,dynamo-style", "--rates", str(ZERO_LOAD_RATE), "--size", size,
           "--requests", str(ZERO_LOAD_REQUESTS if size != "tiny" else 4), "--profile-file", str(profile)]
    log(" ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    (out / "zero_load.log").write_text(r.stderr[-30000:])
    f = work / "gpu_serve.json"
    if f.exists():
        (out / "zero_load.json").write_text(f.read_text())
    return r.returncode


# ------------------------------------------------------------------ the twin half
def calibrate_path(zero_load: Path, profile: Path, cpu_pre: Path) -> dict[str, Any]:
    """``request_path_ms`` of each system's profile: the served TTFT p50 at zero load minus the twin's
    (the same requests, the profile without a path term). ``decode_loop_overhead_ms`` of the
    measured profile: the served TPOT p50 at zero load minus the twin's without that term (the
    decode loop's host time per iteration beyond the profiled step; the mean over the systems,
    which run the same decode worker). Writes both into the profile files."""
    from easerve_runtime.api import parse_spec
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    run = json.loads(zero_load.read_text())
    out: dict[str, Any] = {}
    decode_gaps: list[float] = []
    with tempfile.TemporaryDirectory() as t:
        for system, s in run["systems"].items():
            target = cpu_pre if system == "dynamo-style" else profile
            (p,) = s["points"]
            spec = parse_spec(twin_spec(s["spec"], merged_profile(Path(t), profile, cpu_pre if target == cpu_pre else None,
                                                                   path_ms=0.0, decode_overhead_ms=0.0)))
            reqs = generate(spec, p["rate"], int(p["requests"]), BENCH_SEED)
            res = simulate_system(spec, reqs, "easerve", host_gpus=run.get("host_gpus")).summary
            gap_ms = 1e3 * (p["ttft"]["p50"] - res["ttft"]["p50"])
            decode_gaps.append(1e3 * (p["tpot"]["p50"] - res["tpot"]["p50"]))
            doc = json.loads(target.read_text())
            doc["engine"]["request_path_ms"] = round(max(0.0, gap_ms), 1)
            target.write_text(json.dumps(doc, indent=1) + "\n")
            out[system] = {"rate": p["rate"], "requests": p["requests"], "measured_ttft_p50": p["ttft"]["p50"],
                           "twin_ttft_p50_without_path": res["ttft"]["p50"], "request_path_ms": doc["engine"]["request_path_ms"],
                           "measured_tpot_p50": p["tpot"]["p50"], "twin_tpot_p50_without_overhead": res["tpot"]["p50"],
                           "profile": str(target.relative_to(REPO)) if target.is_relative_to(REPO) else str(target)}
    doc = json.loads(profile.read_text())
    doc["engine"]["decode_loop_overhead_ms"] = round(max(0.0, sum(decode_gaps) / len(decode_gaps)), 2) if decode_gaps else 0.0
    profile.write_text(json.dumps(doc, indent=1) + "\n")
    out["decode_loop_overhead_ms"] = doc["engine"]["decode_loop_overhead_ms"]
    return out


def loop_totals(dl: dict[str, Any]) -> tuple[float, float, int]:
    """The aggregated loop's encode and prefill seconds over a point, and its iterations, from the
    point's ``decode_loop`` counters: the totals where the run recorded them (``gpu_serve`` from
    run 22 on), else the per-iteration means times the iterations, which the loop's busy time over
    its mean iteration gives (runs before recorded no count)."""
    iters = dl.get("loop_iterations") or round(1e3 * float(dl["loop_busy_s"]) / float(dl["loop_iteration_ms"]))
    if "loop_encode_s" in dl and "loop_prefill_s" in dl:
        return float(dl["loop_encode_s"]), float(dl["loop_prefill_s"]), int(iters)
    return (float(dl["loop_encode_ms_per_iteration"]) * iters / 1e3,
            float(dl["loop_prefill_ms_per_iteration"]) * iters / 1e3, int(iters))


def disaggregated_loop_points(run: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The points of a run whose decode worker is the disaggregated one (not ``aggregated@``) and
    carries the loop's counters (rows per step, engine step, loop iteration)."""
    return [(system, p) for system, sy in run.get("systems", {}).items() if not system.startswith("aggregated")
            for p in sy.get("points", [])
            if all((p.get("decode_loop") or {}).get(k) for k in ("rows_per_step", "engine_step_ms", "loop_iteration_ms"))]


def host_loop_row_ms(run: dict[str, Any], overhead_ms: float) -> float | None:
    """The served decode loop's host time per running sequence per iteration on the run's host:
    the loop's iteration minus the engine's step (token fan-out to the requests' streams, the
    loop's bookkeeping), less the zero-load ``overhead_ms``, fitted through the origin over the
    rows per step of the run's points (least squares). None: no point carries the counters.

    Why a host property: over runs 18-27 this gap grew 0.07-0.09 ms a row on three H100 hosts,
    0.15-0.18 on one and 0.20-0.27 on five others, in every layout alike, while the engine's step
    at equal rows was the same on all of them."""
    xs, ys = [], []
    for _, p in disaggregated_loop_points(run):
        dl = p["decode_loop"]
        xs.append(float(dl["rows_per_step"]))
        ys.append(float(dl["loop_iteration_ms"]) - float(dl["engine_step_ms"]) - overhead_ms)
    if not xs:
        return None
    return max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs))


def capped_step_row_ms(run_globs: str, profile: Path) -> dict[str, Any]:
    """``engine.mps.decode_row_ms`` and ``decode_row_extra_ms``: the served decode step minus the
    profile's step at the same rows and context, per row, as ``decode_row_ms + decode_row_extra_ms
    x (prefilling pods - 1)`` (least squares through the origin, ``sim.mpsshare.prefill_pods`` of
    each point's served spec), over the capped points of the runs. The engine's own counters
    (``decode_loop.engine_step_ms``), not the latencies: no fit of the twin's outputs enters it."""
    from easerve_runtime.api import parse_spec
    from easerve_runtime.profiles import load_profile_file
    from easerve_runtime.sim.mpsshare import prefill_pods

    prof = load_profile_file(profile)
    rows = []
    for f in run_files(run_globs):
        run = json.loads(Path(f).read_text())
        for system, p in disaggregated_loop_points(run):
            if mps_caps_of(system) is None:
                continue
            extra = max(0, len(prefill_pods(parse_spec(twin_spec(run["systems"][system]["spec"], profile)))) - 1)
            dl = p["decode_loop"]
            n = float(dl["rows_per_step"])
            hist = {int(k): int(v) for k, v in (dl.get("kv_len") or {}).items()}
            kv = sum(k * v for k, v in hist.items()) / sum(hist.values()) if hist else 0.0
            lo, hi = max(1, int(n)), max(1, int(n)) + 1  # the profile's step between the whole rows around n
            w = n - int(n) if n >= 1 else 0.0
            base = 1e3 * ((1 - w) * prof.decode_step_s(lo, lo * kv) + w * prof.decode_step_s(hi, hi * kv))
            rows.append({"file": Path(f).name, "system": system, "rate": p["rate"], "rows": n,
                         "engine_step_ms": float(dl["engine_step_ms"]), "profile_step_ms": round(base, 3),
                         "excess_ms": round(float(dl["engine_step_ms"]) - base, 3), "extra_prefill_pods": extra})
    if not rows:
        raise SystemExit(f"--calibrate-loop: no capped point with the decode loop's counters in {run_globs}")
    # excess = rows * (a + b * extra): the normal equations of the two terms through the origin
    srr = sum(r["rows"] ** 2 for r in rows)
    srx = sum(r["rows"] ** 2 * r["extra_prefill_pods"] for r in rows)
    sxx = sum(r["rows"] ** 2 * r["extra_prefill_pods"] ** 2 for r in rows)
    sre = sum(r["rows"] * r["excess_ms"] for r in rows)
    sxe = sum(r["rows"] * r["extra_prefill_pods"] * r["excess_ms"] for r in rows)
    det = srr * sxx - srx * srx
    if sxx == 0 or abs(det) < 1e-12:  # no point with a second prefilling pod: the one term
        a, b = sre / srr, 0.0
    else:
        a, b = (sre * sxx - srx * sxe) / det, (srr * sxe - srx * sre) / det
    return {"decode_row_ms": round(max(0.0, a), 4), "decode_row_extra_ms": round(max(0.0, b), 4), "points": rows}


def kv_handoff_ms(run_globs: str, max_rate: float | None = None) -> dict[str, Any]:
    """The served KV handoff per request, from the counters of the runs that carry both sides (run
    27 on): the prefill's (the cache copied to the host and put where its decode worker takes it,
    ``prefill["kv-handoff"]``) plus the decode's (taken, staged to the device, admitted:
    ``decode_loop.handoff_ms``) less half an engine step (the wait for the step boundary, which
    the twin's decode worker already has). The twin charges a KV transfer the link's
    ``kv_setup_ms`` plus its bytes at the link's bandwidth (1.2 ms for LLaVA-NeXT 7B's 2,500
    tokens on the profile's link); this is what that setup is on the served path.

    Each path has its own figure: ``kv_handoff_ms`` the host path's (``kv_setup_ms``),
    ``kv_ipc_handoff_ms`` CUDA IPC's (``kv_ipc_setup_ms``; points whose decode opened shares,
    ``used_kv_ipc``). ``max_rate``: only points at or below this rate. The decode's counter runs
    until admission, so near saturation it takes in the admission queue, which the twin's decode
    worker has already; the calibration wants points below saturation."""
    rows = []
    for f in run_files(run_globs):
        run = json.loads(Path(f).read_text())
        for system, p in disaggregated_loop_points(run):
            pre = ((p.get("prefill") or {}).get("kv-handoff") or {}).get("ms_mean")
            dec = p["decode_loop"].get("handoff_ms")
            if pre is None or dec is None or (max_rate is not None and float(p["rate"]) > max_rate):
                continue
            ms = float(pre) + float(dec) - float(p["decode_loop"]["engine_step_ms"]) / 2
            rows.append({"file": Path(f).name, "system": system, "rate": p["rate"], "prefill_ms": pre,
                         "decode_ms": dec, "kv_handoff_ms": round(ms, 2),
                         "path": "kv_ipc" if used_kv_ipc(p) else "host"})

    def mean(path: str) -> float | None:
        ms = [r["kv_handoff_ms"] for r in rows if r["path"] == path]
        return round(sum(ms) / len(ms), 1) if ms else None

    return {"kv_handoff_ms": mean("host"), "kv_ipc_handoff_ms": mean("kv_ipc"), "points": rows}


def write_kv_setup(profile: Path, ms: float, key: str = "kv_setup_ms") -> None:
    """``links.<the profile's link>.<key>`` of a profile file (``kv_setup_ms`` or
    ``kv_ipc_setup_ms``): the shipped link (or the file's own entry) with that setup set to ``ms``."""
    from easerve_runtime.profiles.hardware import load_json

    doc = json.loads(profile.read_text())
    gpu_name = str(doc["profile"]).split("@", 1)[1]
    link = ({**load_json("gpus.json"), **(doc.get("gpus") or {})})[gpu_name]["link"]
    base = (doc.get("links") or {}).get(link) or {k: v for k, v in load_json("links.json")[link].items()}
    doc.setdefault("links", {})[link] = {**base, key: ms}
    profile.write_text(json.dumps(doc, indent=1) + "\n")


def calibrate_kv(run_globs: str, profile: Path, cpu_pre: Path | None = None, write: bool = False,
                 max_rate: float | None = None) -> dict[str, Any]:
    """``links.<link>.kv_setup_ms`` (the host path) and ``kv_ipc_setup_ms`` (CUDA IPC) from the runs'
    KV handoff counters (``kv_handoff_ms``), each where the runs served that path; with ``write``,
    into both profile files."""
    kv = kv_handoff_ms(run_globs, max_rate)
    if kv["kv_handoff_ms"] is None and kv["kv_ipc_handoff_ms"] is None:
        raise SystemExit(f"--calibrate-kv: no point with both sides of the KV handoff counted in {run_globs}")
    out: dict[str, Any] = {"bench": "twin_agreement", "mode": "calibrate-kv",
                           "measured": "gpu (the prefill's and the decode's handoff counters)", "max_rate": max_rate,
                           **kv}
    if write:
        out["written"] = []
        for f in (profile, cpu_pre):
            if f is not None and f.exists():
                for key, ms in (("kv_setup_ms", kv["kv_handoff_ms"]), ("kv_ipc_setup_ms", kv["kv_ipc_handoff_ms"])):
                    if ms is not None:
                        write_kv_setup(f, ms, key)
                out["written"].append(str(f))
    return out


LOOP_TERMS = ("all", "gpu", "host")


def calibrate_loop(run_globs: str, profile: Path, cpu_pre: Path | None = None, write: bool = False,
                   terms: str = "all") -> dict[str, Any]:
    """The decode step's per-row terms, from the served runs' decode-loop counters:
    ``engine.mps.decode_row_ms`` and ``decode_row_extra_ms`` (the GPU's: the step beside capped
    pods over the profile's, per row, and per extra prefilling pod) and
    ``engine.decode_loop_row_ms`` (the host's: the loop's iteration over the step, per row, beyond
    the zero-load overhead; per run file, and over all of them). With ``write``, ``terms`` says
    which go into the profile files: ``gpu`` (the two per-row step terms), ``host`` (the loop's,
    as the mean over the runs' hosts) or ``all``. Why apart: the two come from different runs.
    The GPU's terms want every capped run (18 on), but the host's loop term changed with the KV
    handoff by CUDA IPC (run 28: its staging threads no longer hold the GIL), so it wants only
    the runs that served that path."""
    if terms not in LOOP_TERMS:
        raise ValueError(f"terms: expected one of {LOOP_TERMS}, got '{terms}'")
    from easerve_runtime.sim import mpsshare

    overhead = float((json.loads(profile.read_text()).get("engine") or {}).get("decode_loop_overhead_ms") or 0.0)
    gpu = capped_step_row_ms(run_globs, profile)
    hosts = {}
    for f in run_files(run_globs):
        b = host_loop_row_ms(json.loads(Path(f).read_text()), overhead)
        if b is not None:
            hosts[Path(f).name] = round(b, 4)
    loop_ms = round(sum(hosts.values()) / len(hosts), 4) if hosts else 0.0
    kv = kv_handoff_ms(run_globs)
    out: dict[str, Any] = {"bench": "twin_agreement", "mode": "calibrate-loop",
                           "measured": "gpu (the decode loop's counters) against the profile's decode step",
                           "decode_row_ms": gpu["decode_row_ms"], "decode_row_extra_ms": gpu["decode_row_extra_ms"],
                           "decode_loop_row_ms_by_run": hosts,
                           "decode_loop_row_ms": loop_ms, "decode_loop_overhead_ms": overhead,
                           "kv_handoff_ms": kv["kv_handoff_ms"], "kv_handoff_points": kv["points"], "points": gpu["points"]}
    if write:
        written = []
        for f in (profile, cpu_pre):
            if f is None or not f.exists():
                continue
            doc = json.loads(f.read_text())
            if terms in ("all", "host"):
                doc["engine"]["decode_loop_row_ms"] = loop_ms
            if terms in ("all", "gpu"):
                # a card without its own constants keeps the module's (what the twin charged it) beside the new term
                mps = doc["engine"].get("mps") or {k: v for k, v in mpsshare.DEFAULTS.items()
                                                   if k not in ("decode_row_ms", "decode_row_extra_ms")}
                doc["engine"]["mps"] = {**mps, "decode_row_ms": gpu["decode_row_ms"],
                                        "decode_row_extra_ms": gpu["decode_row_extra_ms"]}
            f.write_text(json.dumps(doc, indent=1) + "\n")
            written.append(str(f))
        out["written"] = written
        out["terms_written"] = terms
    return out


def calibrate_aggregated(run_globs: str, profile: Path, write: bool = False) -> dict[str, Any]:
    """``engine.aggregated`` of the profile: the served aggregated worker's encode and prefill time
    over the same requests' in the twin's aggregated replica (``sim.aggregated``, the profile's
    points alone), at each aggregated system's lowest-rate point that carries the loop's counters
    (a low-load run: ``gpu_serve.py --rates 0.5 --requests 40 --systems aggregated@2048``). With
    ``write``, the mean ratios go into the profile file."""
    from easerve_runtime.api import parse_spec
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as t:
        doc = json.loads(profile.read_text())
        current = (doc.get("engine") or {}).pop("aggregated", None)
        bare = Path(t) / "profile-without-aggregated.json"
        bare.write_text(json.dumps(doc))
        for f in run_files(run_globs):
            run = json.loads(Path(f).read_text())
            for system, sy in run.get("systems", {}).items():
                pts = [p for p in sy.get("points", []) if (p.get("decode_loop") or {}).get("loop_prefill_ms_per_iteration")]
                if not system.startswith("aggregated") or not pts:
                    continue
                p = min(pts, key=lambda q: q["rate"])
                spec = parse_spec(twin_spec(sy["spec"], merged_profile(Path(t), bare, None)))
                agg = spec.aggregated_engine
                reqs = generate(spec, p["rate"], int(p["requests"]), BENCH_SEED)
                res = simulate_system(spec, reqs, "aggregated", layout=(agg.tensor_parallel, 1, agg.token_budget))
                enc, pre, iters = loop_totals(p["decode_loop"])
                if not (res.stats["encode_s"] > 0 and res.stats["prefill_s"] > 0):
                    raise SystemExit(f"--calibrate-aggregated: the twin encoded or prefilled nothing for {system} in {f}")
                rows.append({"file": Path(f).name, "system": system, "rate": p["rate"], "requests": int(p["requests"]),
                             "gpu": {"encode_s": round(enc, 3), "prefill_s": round(pre, 3), "iterations": iters},
                             "twin": {"encode_s": round(res.stats["encode_s"], 3), "prefill_s": round(res.stats["prefill_s"], 3)},
                             "encode_over_profile": round(enc / res.stats["encode_s"], 3),
                             "prefill_over_profile": round(pre / res.stats["prefill_s"], 3)})
    if not rows:
        raise SystemExit(f"--calibrate-aggregated: no aggregated point with the loop's counters in {run_globs}")
    ratios = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in ("encode_over_profile", "prefill_over_profile")}
    out: dict[str, Any] = {"bench": "twin_agreement", "mode": "calibrate-aggregated",
                           "measured": "gpu (the aggregated loop's counters) over twin (the same requests)",
                           "points": rows, "ratios": ratios, "profile_had": current}
    if write:
        doc = json.loads(profile.read_text())
        doc["engine"]["aggregated"] = {**ratios, "measured_on": ", ".join(sorted({r["file"] for r in rows}))}
        profile.write_text(json.dumps(doc, indent=1) + "\n")
        out["written"] = str(profile)
    return out


def sim_spec(spec: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """A copy of a run's spec served by the sim engine with ``engine``'s profile (no weights to load)."""
    d = json.loads(json.dumps(spec))
    d["model"].pop("path", None)
    d["model"].pop("randomWeights", None)
    d["engine"] = {"backend": "sim", **engine}
    return d


def twin_spec(spec: dict[str, Any], pfile: Path) -> dict[str, Any]:
    """A run's spec, served by the sim engine on the measured profile (and its model's name)."""
    d = sim_spec(spec, {"profileFile": str(pfile)})
    d["model"]["name"] = json.loads(pfile.read_text())["profile"].split("@")[0]
    return d


def merged_profile(tmp: Path, profile: Path, encode_from: Path | None, path_ms: float | None = None,
                   decode_overhead_ms: float | None = None) -> Path:
    """The measured profile, its encode points and request path replaced by ``encode_from``'s (the
    CPU-preprocess run's); ``path_ms`` overrides the request path (0: the engines alone), and
    ``decode_overhead_ms`` the decode loop's overhead (0: the profiled step alone)."""
    doc = json.loads(profile.read_text())
    if encode_from is not None:
        other = json.loads(encode_from.read_text())["engine"]
        doc["engine"]["encode_host"] = encode_host_points(doc["engine"]["encode"], other["encode"])
        doc["engine"]["encode"] = other["encode"]
        doc["engine"]["request_path_ms"] = other.get("request_path_ms")
    if path_ms is not None:
        doc["engine"]["request_path_ms"] = path_ms
    if decode_overhead_ms is not None:
        doc["engine"]["decode_loop_overhead_ms"] = decode_overhead_ms
    f = tmp / f"profile-{'cpu' if encode_from else 'gpu'}.json"
    f.write_text(json.dumps(doc))
    return f


def encode_host_points(on_gpu: list[dict[str, Any]], on_cpu: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The host's part of each CPU-preprocessing encode point (``engine.encode_host``): what it takes
    beyond the GPU-preprocessing run's encode at the same items (``profiles.curves.Curve`` through
    that run's points, its end segments continued beyond them). Why: the CPU run's encoder holds the
    GPU only for its tower, while the twin would otherwise count its whole batch as GPU work in
    flight and charge prefill and decode for it. The GPU run's encode still holds its own (fast)
    preprocessing, so this is the least the host takes: the twin holds the GPU at most that little
    too long."""
    from easerve_runtime.profiles.curves import Curve

    if not on_gpu:
        return []
    gpu_ms = Curve(((int(p["items"]), float(p["ms"])) for p in on_gpu), extrapolate=True)
    out = []
    for p in on_cpu:
        host = float(p["ms"]) - gpu_ms(int(p["items"]))
        if host > 0:
            out.append({"items": int(p["items"]), "ms": round(host, 3)})
    return out


def cpu_preprocess_of(profile: Path) -> Path:
    """The CPU-preprocessing encode run that ``--measure`` writes beside an engine profile (its
    committed name: ``..._llava7b_cpu_preprocess_<run>.json`` next to ``..._llava7b_<run>.json``)."""
    return profile.with_name(profile.name.replace("llava7b", "llava7b_cpu_preprocess"))


def system_profile(system: str, tmp: Path, profile: Path, cpu_pre: Path) -> Path:
    """The profile the twin times ``system`` with: the measured one, with the CPU-preprocessing
    run's encode points for a system that decodes its images on the CPU (the Dynamo-style ones and
    ``easerve:...:cpu``: ``spec.encode.preprocessing: cpu``) when that run is on record."""
    from gpu_systems import parse

    on_cpu = parse(system).cpu_preprocessing
    return merged_profile(tmp, profile, cpu_pre if on_cpu and cpu_pre.exists() else None)


def mps_caps_of(system: str) -> dict[str, float] | None:
    """The per-stage SM caps a ``+mpsNN`` system ran under (``gpu_systems``), as fractions; None
    for a system that time-sliced its GPU."""
    from gpu_systems import MPS_CAPPED, parse

    s = parse(system)
    return None if s.mps is None else {stage: s.mps / 100.0 for stage in MPS_CAPPED}


def used_kv_ipc(point: dict[str, Any]) -> bool:
    """Whether a served point handed its KV caches over by CUDA IPC: its decode opened shares
    (``decode_loop.ipc_opened``). Runs before the IPC path (run 27 and earlier) carry no such
    counter and took the host path."""
    return bool((point.get("decode_loop") or {}).get("ipc_opened"))


def served_door_capacity(run: dict[str, Any], system: str, spec: dict[str, Any], tmp: Path) -> float:
    """The saturation rate the run's frontend sized its admission queue from: that of the profile
    its pods read (``workers.frontend.measured_capacity``), which for an H100 run up to run 32 is the
    H200's (``SERVED_BEFORE_RUN33``), not the H100 profile the twin times it with. The twin's door
    sized from the twin's own profile admitted 2 requests more than the GPU's frontend did on runs
    28-32 (22 against 20 for the pick, 20 against 18 for Dynamo-style)."""
    from easerve_runtime.api import parse_spec
    from easerve_runtime.profiles.capacity import saturation_rps

    if (spec.get("engine") or {}).get("profile"):  # runs 1-10: the shipped profile, by name
        doc = sim_spec(spec, {"profile": spec["engine"]["profile"]})
    else:
        name = run.get("served_profile")
        served = SERVED_BEFORE_RUN33 if name is None else RESULTS / name
        sub = tmp / "served"
        sub.mkdir(exist_ok=True)
        doc = twin_spec(spec, system_profile(system, sub, served, cpu_preprocess_of(served)))
    return saturation_rps(parse_spec(doc), host_gpus=run.get("host_gpus"))


def legacy_prompt_tokens(n: int) -> int:
    """The tokens ``easerve bench``'s old text of an ``n``-token prompt (``LEGACY_FILLER`` repeated,
    cut at ``4 n`` characters) is to the BPE ``easerve model init`` trains: 5 a word, and 0, 2 or 3
    for the cut word's first 0, 2 or 4 characters (checked against that tokenizer by
    ``test_the_old_fillers_token_count_is_what_the_tokenizer_made_of_it``)."""
    chars = 4 * n
    return 5 * (chars // 6) + (0, 1, 2, 3, 3, 4)[chars % 6]


def prompt_filler_of(run: dict[str, Any]) -> str:
    """The filler a GPU run's bench sent: ``prompt_filler`` where the run records it (from run 34 on);
    run 33, the first sent at the workload's lengths, predates that field and is told by its
    ``served_profile`` (recorded from run 33 on); every run before it sent ``LEGACY_FILLER``."""
    from easerve_runtime.bench.payloads import PROMPT_FILLER

    return str(run.get("prompt_filler") or (PROMPT_FILLER if "served_profile" in run else LEGACY_FILLER))


def served_requests(reqs: list[Any], filler: str) -> list[Any]:
    """The workload's requests with the prompt lengths the engine was sent under ``filler``: the
    twin replays a run at the lengths its GPU prefilled, not at the ones its workload meant."""
    import dataclasses

    from easerve_runtime.bench.payloads import PROMPT_FILLER

    if filler == PROMPT_FILLER:
        return reqs
    if filler != LEGACY_FILLER:
        raise ValueError(f"prompt_filler: no token count known for {filler!r}")
    return [dataclasses.replace(r, prompt_tokens=legacy_prompt_tokens(r.prompt_tokens)) for r in reqs]


def twin_point(spec: EPDDeploymentSpec, rate: float, requests: int, host_gpus: int | None,
               mps_caps: dict[str, float] | None = None, model: Any = None, kv_ipc: bool = True,
               frontends: int = 1, door_capacity_rps: float | None = None,
               filler: str | None = None, stages: bool = False) -> dict[str, Any]:
    """The twin's summary of one GPU point: ``spec`` (a run's spec as ``twin_spec`` makes it) on the
    bench's requests (``workload.generate`` at that rate and count, the bench's seed) on a host of
    ``host_gpus`` GPUs (under MPS with ``mps_caps``, else time-sliced). ``model``: the spec's stage
    model, given (``--mps-fit`` passes one carrying a grid point's MPS constants); None: built.
    ``kv_ipc``: the KV handoffs between processes on one GPU go by CUDA IPC (the runtime's
    default), else by the host. ``frontends``: the door (``sim.frontdoor``): ``easerve serve`` runs
    one frontend, which refuses requests (429) once its admission queue is full. Run 28 served past
    saturation: with the door open the twin queued every request and read P99 TTFT 1.3-3.5x the
    GPU's there; through the door it refuses about as many as the GPU's frontend did.
    ``door_capacity_rps``: the rate the door sizes its queue from (``served_door_capacity``; None:
    the spec's profile's). ``filler``: the run's bench filler (``prompt_filler_of``): the prompts
    are replayed at the lengths it made (None: the workload's own). ``stages``: the summary also
    carries ``stage_over_profile`` (``stage_ratios``), what the workers' counters read on the GPU."""
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    reqs = generate(spec, rate, requests, BENCH_SEED)
    if filler is not None:
        reqs = served_requests(reqs, filler)
    if spec.mode == "aggregated":  # the twin's aggregated replica, in the spec's own layout
        agg = spec.aggregated_engine
        layout = (agg.tensor_parallel, max(1, spec.gpu_budget // agg.tensor_parallel), agg.token_budget)
        return simulate_system(spec, reqs, "aggregated", layout=layout).summary
    # the run's own host: its processes time-slice the GPUs they share (sim.timeslice), or run
    # side by side under MPS with SM caps (sim.mpsshare)
    res = simulate_system(spec, reqs, "easerve", model, host_gpus=host_gpus, mps_caps=mps_caps,
                          kv_ipc=kv_ipc, frontends=frontends, door_capacity_rps=door_capacity_rps)
    out = {**res.summary, **decode_rows(res.stats)}
    return {**out, "stage_over_profile": stage_ratios(res.stats)} if stages else out


def decode_rows(stats: dict[str, Any]) -> dict[str, float]:
    """The twin's decode loop as the GPU's counters read it: sequences a step (``decode_rows``) and
    milliseconds a loop iteration (``decode_iteration_ms``). A token costs about one iteration, and
    the iteration grows with the rows; where the twin's TPOT misses, these say whether it keeps too
    few requests in decode or steps them too fast (2026-12-07: at run 33b's s 0.9 point, both)."""
    if not stats.get("decode_steps"):
        return {}
    return {"decode_rows": round(float(stats["mean_decode_batch"]), 2),
            "decode_iteration_ms": round(float(stats["decode_ms_per_step"]), 2)}


def gpu_decode_rows(point: dict[str, Any]) -> dict[str, float]:
    """``decode_rows``'s figures off a GPU point's decode loop counters (empty where none)."""
    dl = point.get("decode_loop") or {}
    if not dl.get("rows_per_step") or not dl.get("loop_iteration_ms"):
        return {}
    return {"decode_rows": float(dl["rows_per_step"]), "decode_iteration_ms": float(dl["loop_iteration_ms"])}


def stage_ratios(stats: dict[str, Any]) -> dict[str, float]:
    """Each stage's time over its profile's for the same batches, as the twin ran them (``encode``,
    and each prefill stage by name: ``prefill``, ``local-prefill``): the figures the workers'
    counters read on the GPU (``engine_over_profile``)."""
    out = {}
    if stats.get("encode_over_profile"):
        out["encode"] = float(stats["encode_over_profile"])
    for st, v in (stats.get("prefill") or {}).items():
        if v.get("over_profile") is not None:
            out[st] = float(v["over_profile"])
    return out


def gpu_stage_ratios(point: dict[str, Any]) -> dict[str, float]:
    """``stage_ratios``'s figures off a GPU point's counters (run 17 on; empty before)."""
    out = {}
    if (point.get("encode") or {}).get("engine_over_profile"):
        out["encode"] = float(point["encode"]["engine_over_profile"])
    for st, v in (point.get("prefill") or {}).items():
        if isinstance(v, dict) and v.get("engine_over_profile"):
            out[st] = float(v["engine_over_profile"])
    return out


def predict(run: dict[str, Any], tmp: Path, profile: Path, cpu_pre: Path, host_loop: str = "run",
            lengths: str = "served") -> dict[str, Any]:
    """The twin's prediction of each point of one GPU run, beside the measured figures. ``host_loop``
    ``run``: the twin's decode loop costs the run host's own time per row (``host_loop_row_ms``,
    read off the run's loop counters: a property of its CPU, as a profile measured on that host
    would carry); ``profile``: the profile's ``decode_loop_row_ms``."""
    import copy

    from easerve_runtime.api import parse_spec
    from easerve_runtime.sim.systems import model_for

    overhead = float((json.loads(profile.read_text()).get("engine") or {}).get("decode_loop_overhead_ms") or 0.0)
    b = host_loop_row_ms(run, overhead) if host_loop == "run" else None
    out: dict[str, Any] = {}
    for system, s in run["systems"].items():
        pfile = system_profile(system, tmp, profile, cpu_pre)
        spec = parse_spec(twin_spec(s["spec"], pfile))
        caps = mps_caps_of(system)
        model = None
        if b is not None and not system.startswith("aggregated"):
            model = copy.copy(model_for(spec))
            model.decode_row_overhead_s = b / 1e3
        pts = sorted(s.get("points", []), key=lambda p: p["rate"])
        sat = max((p.get("throughput") or 0.0 for p in pts), default=0.0)
        door = None if system.startswith("aggregated") else served_door_capacity(run, system, s["spec"], tmp)
        rows = []
        for p in pts:
            res = twin_point(spec, p["rate"], int(p["requests"]), run.get("host_gpus"), caps, model, used_kv_ipc(p),
                             door_capacity_rps=door, filler=prompt_filler_of(run) if lengths == "served" else None)
            m_tp, m_ttft = p.get("throughput"), p.get("ttft_p99")
            t_tp, t_ttft = res.get("throughput"), (res.get("ttft") or {}).get("p99")
            row = {
                "rate": p["rate"],
                "measured": {"throughput": m_tp, "ttft_p99": m_ttft, "ttft_p50": (p.get("ttft") or {}).get("p50"),
                             "tpot_p50": (p.get("tpot") or {}).get("p50"), "failed": p.get("failed"),
                             "goodput_moderate": (p.get("goodput") or {}).get("moderate"),
                             # the first-to-second token gap (KV handoff and decode's admission):
                             # runs since 2026-12-07 record it; where TPOT's miss sits
                             "token2_gap_p50": (p.get("token2_gap") or {}).get("p50"), **gpu_decode_rows(p)},
                "twin": {"throughput": t_tp, "ttft_p99": t_ttft, "ttft_p50": (res.get("ttft") or {}).get("p50"),
                         "tpot_p50": (res.get("tpot") or {}).get("p50"), "failed": res.get("failed"),
                         "goodput_moderate": (res.get("goodput") or {}).get("moderate"),
                         "token2_gap_p50": (res.get("token2_gap") or {}).get("p50"),
                         **{k: res[k] for k in ("decode_rows", "decode_iteration_ms") if k in res}},
                # a one-rate run does not show its saturation: whether it is in scope is unknown there
                "in_scope": (bool(sat) and p["rate"] <= BAR["up_to_saturation"] * sat) if len(pts) > 1 else None,
            }
            if m_tp and t_tp is not None:
                row["throughput_ratio"] = round(t_tp / m_tp, 3)
            if m_ttft and t_ttft is not None:
                row["ttft_p99_ratio"] = round(t_ttft / m_ttft, 3)
            row["meets_bar"] = (row["in_scope"] is not False and abs(row.get("throughput_ratio", 9) - 1) <= BAR["throughput"]
                                and abs(row.get("ttft_p99_ratio", 9) - 1) <= BAR["ttft_p99"])
            rows.append(row)
        path_ms = json.loads(pfile.read_text())["engine"].get("request_path_ms")
        out[system] = {"profile": pfile.name, "request_path_ms": path_ms, "saturation_req_s": sat, "points": rows,
                       "decode_loop_row_ms": round(b, 4) if model is not None and b is not None else None,
                       "diagnosis": diagnose(rows)}
    return out


def diagnose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the lowest-rate point (next to no queueing) says the twin leaves out: the TTFT p50 gap
    is a per-request cost outside the engines (HTTP, parsing, request-plane hops, embedding bytes
    over the wire); the TPOT p50 ratio is decode slowed by the other stages' processes sharing
    its GPU (the twin gives each pool its own). A diagnosis read off the runs, not a model input."""
    if not rows:
        return {}
    low = rows[0]
    m, t = low["measured"], low["twin"]
    out: dict[str, Any] = {"at_rate": low["rate"]}
    if m.get("ttft_p50") is not None and t.get("ttft_p50") is not None:
        out["ttft_p50_gap_s"] = round(m["ttft_p50"] - t["ttft_p50"], 4)
    if m.get("tpot_p50") and t.get("tpot_p50"):
        out["tpot_p50_measured_over_twin"] = round(m["tpot_p50"] / t["tpot_p50"], 3)
    return out


def report(profile: Path, cpu_pre: Path, runs_glob: str = str(RESULTS / "gpu_serve_h200_*.json"),
           host_loop: str = "run", lengths: str = "served") -> dict[str, Any]:
    """The twin fed ``profile`` against every GPU run that ``runs_glob`` matches (``host_loop``: ``predict``'s).
    ``lengths``: ``served`` replays each run at the prompt lengths its bench sent (``prompt_filler_of``);
    ``workload`` at the workload's own, as every report before 2026-12-07 did (to reproduce them)."""
    if not profile.exists():
        raise SystemExit(f"{profile} is missing: run --measure on the GPU machine first")
    prof = json.loads(profile.read_text())
    from easerve_runtime.profiles import load_profile_file

    p = load_profile_file(profile)
    assert p.corrections is not None
    runs = []
    with tempfile.TemporaryDirectory() as t:
        for f in run_files(runs_glob):
            run = json.loads(Path(f).read_text())
            if run.get("measured") != "gpu":
                continue
            runs.append({"file": str(Path(f).resolve().relative_to(REPO)), "gpu": run.get("gpu"),
                         "host_gpus": run.get("host_gpus"), "mps": bool(run.get("mps")),
                         "requests_per_point": run.get("requests_per_point"),
                         "systems": predict(run, Path(t), profile, cpu_pre, host_loop, lengths)})
    return {"bench": "twin_agreement", "measured": "gpu (runs) vs twin (prediction)", "profile": prof["profile"],
            "profile_source": prof["engine"]["device"], "host_loop": host_loop, "lengths": lengths,
            "ratios_measured_over_model": p.corrections.summary(),
            "bar": BAR, "runs": runs}


def plot_points(rep: dict[str, Any], path: Path) -> None:
    """Runs of one rate each (item 5's deploys): the twin against the GPU, point by point, for
    throughput, P99 TTFT, TPOT p50 and moderate-tier goodput (on the diagonal: agreement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("throughput", "ttft_p99", "tpot_p50", "goodput_moderate")
    fig, axes = plt.subplots(1, len(keys), figsize=(16, 4))
    for r in rep["runs"]:
        for system, s in r["systems"].items():
            for p in s["points"]:
                for ax, key in zip(axes, keys, strict=True):
                    m, t = p["measured"].get(key), p["twin"].get(key)
                    if m is not None and t is not None:
                        ax.scatter(m, t, s=18)
                        ax.annotate(f"{system}@{p['rate']:g}", (m, t), fontsize=5, alpha=0.7)
    for ax, key in zip(axes, keys, strict=True):
        lo, hi = ax.get_xlim()
        lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], ls=":", color="grey")
        ax.set(xlabel=f"{key} (GPU)", ylabel=f"{key} (twin)", title=key)
        ax.grid(alpha=0.3)
    gpus = card_names(r.get("gpu") for r in rep["runs"])
    fig.suptitle(f"the twin fed the engine's profile ({rep['profile_source']}) against the {gpus} runs, point by point")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [len(s["points"]) for r in rep["runs"] for s in r["systems"].values()]
    if sum(c <= 1 for c in counts) * 2 > len(counts):  # mostly one rate a system: no curves to draw
        return plot_points(rep, path)
    run = max((r for r in rep["runs"] if not r["mps"]), key=lambda r: (r["requests_per_point"] or 0, r["file"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system, s in run["systems"].items():
        rates = [p["rate"] for p in s["points"]]
        for ax, key in zip(axes, ("throughput", "ttft_p99"), strict=True):
            line = ax.plot(rates, [p["measured"][key] for p in s["points"]], marker="o", label=f"{system} (GPU)")
            ax.plot(rates, [p["twin"][key] for p in s["points"]], marker="x", ls="--", color=line[0].get_color(),
                    label=f"{system} (twin)")
    axes[0].set(xlabel="offered rate (req/s)", ylabel="throughput (req/s)", title=f"{run['file'].split('/')[-1]}")
    axes[1].set(xlabel="offered rate (req/s)", ylabel="P99 TTFT (s)", yscale="log",
                title=f"twin fed the engine's profile vs the {card_names([run.get('gpu')])}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


MPS_GRID = {"contention": (0.0, 0.05, 0.1, 0.2, 0.3, 0.4), "decode_corun": (0.0, 0.3, 0.6, 0.9),
            "decode_saturation": (0.05, 0.4), "encode_corun": (0.0, 0.3, 0.6, 0.9, 1.2, 1.5, 1.8),
            "decode_contention": (0.0, 0.3)}
"""The grid ``--mps-fit`` searches (672 points, ~10 min on 2 cores). Widened 2026-12-07: refitted at
the lengths the runs prefilled (``prompt_filler_of``), the best point sat on the old grid's edges
(contention 0.1, encode_corun 1.2). ``decode_row_ms`` is not searched: it is read off the fit runs'
own decode counters (``capped_step_row_ms``), a measurement, as the hosts' loop cost per row is."""
MPS_FIT_MAX_RATE = 7.0
"""``--mps-fit`` fits ``sim.mpsshare``'s constants on the capped points at or below this rate and
reports the points above it as held out (runs 14-15: fitted on 5.5 and 7 req/s, checked at 8.5,
past the one H200's saturation, where repeats of one point moved 3x). ``--held-out RUNS`` holds
out whole runs as well (other hosts)."""
MPS_KEYS = MPS_CONSTANTS  # the constants a profile may carry (engine.mps), in one place


def mps_points(profile: Path, cpu_pre: Path, runs_glob: str, tmp: Path,
               held_out_glob: str = "", door: bool = False) -> list[tuple[str, Any, dict[str, Any], int | None]]:
    """The ``+mpsNN`` points of the runs (and of ``held_out_glob``'s, marked ``held_out_run``), one
    per (system, rate, held out or not): a point measured more than once is the mean of its
    repeats (``gpu_serve.mean_of_repeats``), so a repeat neither counts twice nor is dropped. Each
    point carries its host's decode-loop cost per row (``loop_row_ms``: the mean over its runs'
    files, ``host_loop_row_ms``). ``door``: each point also carries the rate its frontend sized
    its admission queue from (``door_rps``, ``served_door_capacity``), and repeats served behind
    doors of different sizes (run 34d read the H200's profile) stay separate points."""
    from easerve_runtime.api import parse_spec
    from gpu_serve import mean_of_repeats

    overhead = float((json.loads(profile.read_text()).get("engine") or {}).get("decode_loop_overhead_ms") or 0.0)
    groups: dict[tuple[str, float, bool, str, float], list[dict[str, Any]]] = {}
    specs: dict[str, tuple[Any, int | None]] = {}
    held_files = {str(Path(f).resolve()) for f in run_files(held_out_glob)} if held_out_glob else set()
    files = run_files(runs_glob) + sorted(held_files - {str(Path(f).resolve()) for f in run_files(runs_glob)})
    for f in files:
        run = json.loads(Path(f).read_text())
        held = str(Path(f).resolve()) in held_files
        b = host_loop_row_ms(run, overhead)
        for system, sy in run.get("systems", {}).items():
            if mps_caps_of(system) is None:
                continue
            if system not in specs:
                specs[system] = (parse_spec(twin_spec(sy["spec"], system_profile(system, tmp, profile, cpu_pre))),
                                 run.get("host_gpus"))
            door_rps = round(served_door_capacity(run, system, sy["spec"], tmp), 4) if door else 0.0
            for p in sy.get("points", []):
                groups.setdefault((system, float(p["rate"]), held, prompt_filler_of(run), door_rps), []).append(
                    {**p, "file": Path(f).name, "loop_row_ms": b})
    out = []
    for (system, _, held, filler, door_rps), ps in sorted(groups.items()):
        bs = [q["loop_row_ms"] for q in ps if q.get("loop_row_ms") is not None]
        p = {**mean_of_repeats(ps), "held_out_run": held, "loop_row_ms": sum(bs) / len(bs) if bs else None,
             "prompt_filler": filler, **({"door_rps": door_rps} if door else {})}
        out.append((system, specs[system][0], p, specs[system][1]))
    return out


_FIT: dict[str, Any] = {}
"""``--mps-fit``'s points and stage models, set before its worker processes fork (read, never written, by them)."""


def _fit_rows(values: tuple[float, ...]) -> list[dict[str, Any]]:
    """The twin against the GPU at every fit point, at one grid point's MPS constants."""
    import copy
    import math

    rows = []
    for system, spec, p, host in _FIT["pts"]:
        model = copy.copy(_FIT["models"][system])
        model.mps_constants = dict(zip(_FIT["keys"], values, strict=True))
        if _FIT["host_loop"] == "run" and p.get("loop_row_ms") is not None:
            model.decode_row_overhead_s = p["loop_row_ms"] / 1e3
        # door open, as the constants were first fitted (runs 14-27, up to 7 req/s: below saturation,
        # where the frontend refused at most a few requests); with --fit-door, the served door
        door = p.get("door_rps")
        res = twin_point(spec, p["rate"], int(p["requests"]), host, mps_caps_of(system), model, used_kv_ipc(p),
                         frontends=1 if door else 0, door_capacity_rps=door, filler=p.get("prompt_filler"),
                         stages=_FIT.get("stages", False))
        meas = {"goodput_moderate": (p.get("goodput") or {}).get("moderate"), "tpot_p50": p["tpot"]["p50"],
                "ttft_p99": p["ttft"]["p99"], "throughput": p.get("throughput")}
        twin = {"goodput_moderate": (res.get("goodput") or {}).get("moderate"),
                "tpot_p50": (res.get("tpot") or {}).get("p50"), "ttft_p99": (res.get("ttft") or {}).get("p99"),
                "throughput": res.get("throughput"), "failed": res.get("failed")}
        err = {k: abs(math.log(max(twin[k] or 1e-3, 1e-3) / max(meas[k] or 1e-3, 1e-3)))
               for k in ("goodput_moderate", "tpot_p50", "ttft_p99")}
        stage_rows = {}
        if _FIT.get("stages"):  # each stage's time against its counters, where the point has them
            gpu_st, twin_st = gpu_stage_ratios(p), res.get("stage_over_profile") or {}
            for k in sorted(set(gpu_st) & set(twin_st)):
                err[f"{k}_over_profile"] = abs(math.log(twin_st[k] / gpu_st[k]))
                stage_rows[k] = {"gpu": round(gpu_st[k], 3), "twin": round(twin_st[k], 3)}
        bar = (bool(meas["throughput"]) and twin["throughput"] is not None and bool(meas["ttft_p99"])
               and twin["ttft_p99"] is not None and abs(twin["throughput"] / meas["throughput"] - 1) <= BAR["throughput"]
               and abs(twin["ttft_p99"] / meas["ttft_p99"] - 1) <= BAR["ttft_p99"])
        rows.append({"system": system, "rate": p["rate"],
                     "held_out": p["rate"] > _FIT.get("max_rate", MPS_FIT_MAX_RATE) or bool(p.get("held_out_run")),
                     "repeats": len(p.get("repeats", [])) or 1, "loop_row_ms": p.get("loop_row_ms"),
                     "measured": meas, "twin": twin, "meets_bar": bar,
                     "abs_log_error": {k: round(v, 3) for k, v in err.items()},
                     **({"stage_over_profile": stage_rows} if stage_rows else {})})
    return rows


def mps_fit(profile: Path, cpu_pre: Path, runs_glob: str, held_out_glob: str = "",
            host_loop: str = "run", stages: bool = False, door: bool = False,
            max_rate: float = MPS_FIT_MAX_RATE) -> dict[str, Any]:
    """Calibrate the MPS twin's constants (``engine.mps``: ``MPS_KEYS``) on the ``+mpsNN`` points of
    the runs: the grid point with the least mean |log(twin / GPU)| over moderate-tier goodput, TPOT
    p50 and P99 TTFT at the fit points; the held-out points' errors (above ``max_rate``, and
    every point of ``held_out_glob``'s runs) at that grid point beside it.

    ``decode_row_ms`` is read off the fit runs' decode counters (``capped_step_row_ms``), and each
    point's twin gets its own host's decode-loop cost per row (``host_loop`` ``run``; ``profile``:
    the profile's). Each grid point rides on a copy of each system's stage model
    (``StageModel.mps_constants``, which ``sim.mpsshare.MPSSharing`` reads before its module
    values), so the fit sets no global state and the profile's own constants are only its starting
    point. The grid runs on every core (forked workers).

    ``stages`` (``--fit-stages``): each point's error also averages in each stage's time over its
    profile against the workers' counters (``gpu_stage_ratios``: the encoder and each prefill
    stage), where the point has them. Why: fitted on the three end-to-end figures alone, runs 33-34
    put the contention at 0.05 and bought TTFT back with an encoder co-run term of 1.8, which
    charges the encoder 1.3-1.6x what its counters read; the valley is flat along that trade.

    ``door`` (``--fit-door``): each point's twin runs behind the door its frontend served
    (``twin_point``'s ``frontends=1`` at the point's ``door_rps``), as ``twin_agreement``'s own
    report does. Why: without it the held-out points past saturation (runs 33-34 at 10-12 req/s)
    queued every request and read P99 TTFT up to 5x the GPU's, so their errors ranked the grid by
    a door the pods do not have.

    ``max_rate`` (``--fit-max-rate``): the points above it are held out (default
    ``MPS_FIT_MAX_RATE``). Why raise it: at 7 req/s and under, TPOT sits far below the moderate
    tier's 25 ms bound, so a TPOT error there moves no goodput; run 35 (8.5 req/s, one H100) showed
    constants fitted there reading every s < 1 layout's TPOT 7-17 % under the GPU's at 8.5, where
    the bound decides, and their goodput up to 1.6x over."""
    import itertools
    import multiprocessing

    from easerve_runtime.sim import mpsshare
    from easerve_runtime.sim.systems import model_for

    current = (json.loads(profile.read_text()).get("engine") or {}).get("mps")
    measured_rows = capped_step_row_ms(runs_glob, profile)
    row_ms = measured_rows["decode_row_ms"]
    with tempfile.TemporaryDirectory() as t:  # the specs name profile files written here
        pts = mps_points(profile, cpu_pre, runs_glob, Path(t), held_out_glob, door)
        models = {system: model_for(spec) for system, spec, _, _ in pts}
    if not pts:
        raise SystemExit(f"--mps-fit: no +mpsNN system in {runs_glob}")
    _FIT.update(pts=pts, models=models, keys=MPS_KEYS, host_loop=host_loop, stages=stages, max_rate=max_rate)

    def score(rows: list[dict[str, Any]], held_out: bool) -> float:
        sel = [r for r in rows if r["held_out"] == held_out]
        return sum(sum(r["abs_log_error"].values()) / len(r["abs_log_error"]) for r in sel) / max(1, len(sel))

    def bar(rows: list[dict[str, Any]], held_out: bool) -> str:
        sel = [r for r in rows if r["held_out"] == held_out]
        return f"{sum(r['meets_bar'] for r in sel)}/{len(sel)}"

    card = {**mpsshare.DEFAULTS, **(current or {})}
    card.setdefault("decode_contention", card["contention"])
    now = tuple(float(card[k]) for k in MPS_KEYS)
    in_code = _fit_rows(now)
    grid_keys = [k for k in MPS_KEYS if k not in ("decode_row_ms", "decode_row_extra_ms")]
    combos = [dict(zip(grid_keys, v, strict=True)) for v in itertools.product(*(MPS_GRID[k] for k in grid_keys))]
    combos = [{**c, "decode_row_ms": row_ms, "decode_row_extra_ms": measured_rows["decode_row_extra_ms"]}
              for c in combos]
    values = [tuple(c[k] for k in MPS_KEYS) for c in combos]
    grid = []
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        for i, rows in enumerate(pool.imap(_fit_rows, values, chunksize=4)):
            grid.append({**combos[i], "fit_error": round(score(rows, False), 4), "held_out_error": round(score(rows, True), 4),
                         "fit_bar": bar(rows, False), "held_out_bar": bar(rows, True), "rows": rows})
            if (i + 1) % 50 == 0 or i + 1 == len(values):
                log(f"grid {i + 1}/{len(values)}: best fit so far {min(g['fit_error'] for g in grid)}")
    best = min(grid, key=lambda g: g["fit_error"])
    cols = (*MPS_KEYS, "fit_error", "held_out_error", "fit_bar", "held_out_bar")
    return {"bench": "twin_agreement", "mode": "mps-fit", "gpus": cards(runs_glob), "fit_rates_up_to": max_rate,
            "held_out_runs": held_out_glob or None, "host_loop": host_loop, "decode_row_ms_from_counters": row_ms,
            "error": "mean over points of the mean |log(twin/GPU)| of moderate goodput, TPOT p50, P99 TTFT"
                     + (" and each stage's time over its profile (the workers' counters)" if stages else ""),
            "fit_stages": stages, "fit_door": door,
            "in_code": {**dict(zip(MPS_KEYS, now, strict=True)), "fit_error": round(score(in_code, False), 4),
                        "held_out_error": round(score(in_code, True), 4), "fit_bar": bar(in_code, False),
                        "held_out_bar": bar(in_code, True),
                        "from": "the profile's engine.mps" if current else "sim.mpsshare (the H200's)"},
            "best": {k: best[k] for k in cols},
            "points": in_code, "best_points": best["rows"],
            "grid": [{k: g[k] for k in cols} for g in grid]}


def write_mps(fit: dict[str, Any], profiles: list[Path], runs: str) -> list[str]:
    """Write ``fit``'s best constants into each profile file as ``engine.mps`` (the card's own, which
    the twin then reads instead of ``sim.mpsshare``'s); returns the files written."""
    written = []
    for f in profiles:
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        doc.setdefault("engine", {})["mps"] = {
            **{k: fit["best"][k] for k in MPS_KEYS if k in fit["best"]},
            "fitted_on": f"twin_agreement.py --mps-fit on {runs} (error {fit['best']['fit_error']}, "
                         f"{fit['in_code']['fit_error']} before)"}
        f.write_text(json.dumps(doc, indent=1) + "\n")
        written.append(str(f))
    return written


def encode_check(profile: Path, cpu_pre: Path, runs_glob: str) -> dict[str, Any]:
    """The encoder, twin against GPU, at every capped point that carries the encode workers' own
    counters (run 17 on): the engine's time per micro-batch over the profile's for the same batches
    (``encode.engine_over_profile``; the twin's ``stats.encode_over_profile``), requests per batch,
    and the point's P99 TTFT beside them; and each stage's time per batch and queue wait per
    request in milliseconds, as the counters read them, so a TTFT miss can be placed in a stage
    without a profile in between (run 23).

    Why: run 17 read the encoder at 2.0-3.2x its profile beside decode under MPS, and the question
    was whether the twin charges that (then a P99 miss lies elsewhere) or not (then the encoder's
    co-run is the fix)."""
    import math

    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    rows = []
    with tempfile.TemporaryDirectory() as t:
        for system, spec, p, host in mps_points(profile, cpu_pre, runs_glob, Path(t)):
            enc, gpu_st = p.get("encode") or {}, gpu_stage_ratios(p)
            if "encode" not in gpu_st:
                continue
            reqs = generate(spec, p["rate"], int(p["requests"]), BENCH_SEED)
            res = simulate_system(spec, reqs, "easerve", host_gpus=host, mps_caps=mps_caps_of(system))
            twin_st = stage_ratios(res.stats)
            gpf = p.get("prefill") or {}
            rows.append({"system": system, "rate": p["rate"],
                         "encode_over_profile": {"gpu": gpu_st["encode"], "twin": round(twin_st.get("encode", 0.0), 3)},
                         "requests_per_batch": {"gpu": enc.get("requests_per_batch"),
                                                "twin": round(float(res.stats.get("mean_encode_batch") or 0.0), 2)},
                         # absolute times, as the counters read them: no profile in between
                         "encode_ms_per_batch": {"gpu": enc.get("engine_ms_per_batch"),
                                                 "twin": round(float(res.stats.get("encode_ms_per_batch") or 0.0), 2)},
                         "encode_queue_wait_ms": {"gpu": enc.get("queue_wait_ms_mean"),
                                                  "twin": round(float(res.stats.get("encode_queue_wait_ms_mean") or 0.0), 2)},
                         "prefill_over_profile": {
                             st: {"gpu": gpu_st.get(st), "twin": None if st not in twin_st else round(twin_st[st], 3)}
                             for st in (res.stats.get("prefill") or {})},
                         "prefill_ms_per_batch": {
                             st: {"gpu": gpf.get(st, {}).get("engine_ms_per_batch"), "twin": round(float(v["ms_per_batch"]), 2)}
                             for st, v in (res.stats.get("prefill") or {}).items()},
                         "prefill_queue_wait_ms": {
                             st: {"gpu": gpf.get(st, {}).get("queue_wait_ms_mean"),
                                  "twin": round(float(v["queue_wait_ms_mean"]), 2)}
                             for st, v in (res.stats.get("prefill") or {}).items()},
                         "ttft_p99": {"gpu": round(p["ttft"]["p99"], 4), "twin": round(float(res.summary["ttft"]["p99"]), 4)},
                         "ttft_p50": {"gpu": round(p["ttft"]["p50"], 4), "twin": round(float(res.summary["ttft"]["p50"]), 4)}})
    if not rows:
        raise SystemExit(f"--encode-check: no capped point with encode counters in {runs_glob}")
    err = [abs(math.log(r["encode_over_profile"]["twin"] / r["encode_over_profile"]["gpu"])) for r in rows]
    return {"bench": "twin_agreement", "mode": "encode-check",
            "mean_abs_log_error_encode_over_profile": round(sum(err) / len(err), 4), "points": rows}


def plot_mps_fit(fit: dict[str, Any], path: Path) -> None:
    """The capped points, GPU against the twin at the constants in code (fit points and held-out
    ones); the grid's best beside them is in the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("goodput_moderate", "moderate goodput (req/s)", 1.0), ("tpot_p50", "TPOT p50 (ms)", 1e3),
            ("ttft_p99", "P99 TTFT (s)", 1.0))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label, scale) in zip(axes, keys, strict=True):
        top = fit.get("fit_rates_up_to", MPS_FIT_MAX_RATE)
        for held, marker, name in ((False, "o", f"fit (up to {top:g} req/s)"),
                                   (True, "x", f"held out (above {top:g} req/s, or other hosts)")):
            rows = [r for r in fit["points"] if r["held_out"] == held]
            ax.scatter([r["measured"][key] * scale for r in rows], [(r["twin"][key] or 0.0) * scale for r in rows],
                       marker=marker, label=name)
        hi = max(max(r["measured"][key], r["twin"][key] or 0.0) for r in fit["points"]) * scale * 1.1
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
        ax.set(xlabel=f"GPU: {label}", ylabel=f"twin: {label}", xlim=(0, hi), ylim=(0, hi))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    b = fit["in_code"]
    fig.suptitle(f"sim.mpsshare (constants in code) against the {fit.get('gpus', 'GPU')} under MPS caps: contention "
                 f"{b['contention']}, decode co-run {b['decode_corun']}, decode saturation {b['decode_saturation']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="on the GPU machine: measure the engine profiles")
    p.add_argument("--measure-path", action="store_true", help="on the GPU machine: serve both systems at zero load")
    p.add_argument("--calibrate-path", default=None, metavar="ZERO_LOAD_JSON",
                   help="write request_path_ms into the profiles from a --measure-path run")
    p.add_argument("--out", default=None, help="--measure: output directory ($OUT)")
    p.add_argument("--size", default="7b", choices=["tiny", "7b"], help="--measure: tiny is a CPU smoke")
    p.add_argument("--requests", type=int, default=16, help="--measure: prompts to prefill")
    p.add_argument("--profile", default=str(PROFILE), help="the engine profile (easerve's preprocessing)")
    p.add_argument("--profile-cpu-preprocess", default=str(PROFILE_CPU_PRE), help="encode points, CPU preprocessing")
    p.add_argument("--runs", default=str(RESULTS / "gpu_serve_h200_*.json"),
                   help="the GPU runs to predict (globs of gpu_serve result files, comma-separated)")
    p.add_argument("--plot", default=None,
                   help="the PNG (default docs/img/twin_agreement.png; with --mps-fit docs/img/twin_mps_fit.png)")
    p.add_argument("--mps-fit", action="store_true",
                   help="calibrate sim.mpsshare's constants on the runs' +mpsNN points (fit up to --fit-max-rate, "
                        "the rest held out); prints the grid and the best point")
    p.add_argument("--fit-max-rate", type=float, default=MPS_FIT_MAX_RATE,
                   help="--mps-fit: the points above this rate (req/s) are held out")
    p.add_argument("--fit-stages", action="store_true",
                   help="--mps-fit: also score each stage's time over its profile against the workers' counters")
    p.add_argument("--fit-door", action="store_true",
                   help="--mps-fit: run each point's twin behind the door its frontend served (as the report does), "
                        "not with the door open")
    p.add_argument("--write-profile", action="store_true",
                   help="with --mps-fit: write the best constants into --profile and --profile-cpu-preprocess "
                        "(engine.mps, the card's own; the twin reads them instead of sim.mpsshare's); with "
                        "--calibrate-aggregated: write engine.aggregated into --profile")
    p.add_argument("--calibrate-aggregated", default=None, metavar="RUNS",
                   help="engine.aggregated: the served aggregated loop's encode and prefill per request over the "
                        "twin's, at each aggregated system's lowest rate in RUNS (globs); with --write-profile, "
                        "written into --profile")
    p.add_argument("--calibrate-loop", default=None, metavar="RUNS",
                   help="engine.mps.decode_row_ms (the GPU's per-row step beside capped pods) and "
                        "engine.decode_loop_row_ms (the host's per-row loop time) from the decode counters of RUNS "
                        "(globs); with --write-profile, written into --profile and --profile-cpu-preprocess "
                        "(--loop-terms says which)")
    p.add_argument("--loop-terms", choices=LOOP_TERMS, default="all",
                   help="with --calibrate-loop --write-profile: write the GPU's per-row step terms (gpu), the "
                        "host's loop term (host) or both (all); e.g. gpu over runs 18-28, host over run 28 only")
    p.add_argument("--calibrate-kv", default=None, metavar="RUNS",
                   help="links.<link>.kv_setup_ms (host path) and kv_ipc_setup_ms (CUDA IPC, run 28 on): the served "
                        "KV handoff per request (prefill's side plus decode's take and stage, less half a step) from "
                        "the counters of RUNS (globs, run 27 on); with --write-profile, written into --profile and "
                        "--profile-cpu-preprocess")
    p.add_argument("--kv-max-rate", type=float, default=None,
                   help="with --calibrate-kv: only points at or below this rate (below saturation: the decode's "
                        "counter takes in its admission queue)")
    p.add_argument("--host-loop", default="run", choices=["run", "profile"],
                   help="the decode loop's host time per row the twin charges for a run: the run's own host's, read "
                        "off its loop counters (run), or the profile's decode_loop_row_ms (profile)")
    p.add_argument("--lengths", default="served", choices=["served", "workload"],
                   help="the prompt lengths each run is replayed at: those its bench sent (served: runs up to 32 "
                        "sent ~3.3x their text prompts) or the workload's own (how reports before 2026-12-07 ran)")
    p.add_argument("--held-out", default="",
                   help="with --mps-fit: runs (globs) whose points are held out of the fit (other hosts)")
    p.add_argument("--encode-check", action="store_true",
                   help="the encoder's time per micro-batch over its profile's, twin against the encode counters (run 17 on)")
    args = p.parse_args()
    if args.calibrate_kv:
        print(json.dumps(calibrate_kv(args.calibrate_kv, Path(args.profile), Path(args.profile_cpu_preprocess),
                                      args.write_profile, args.kv_max_rate), indent=1))
        return 0
    if args.calibrate_loop:
        print(json.dumps(calibrate_loop(args.calibrate_loop, Path(args.profile), Path(args.profile_cpu_preprocess),
                                        args.write_profile, args.loop_terms), indent=1))
        return 0
    if args.calibrate_aggregated:
        print(json.dumps(calibrate_aggregated(args.calibrate_aggregated, Path(args.profile), args.write_profile), indent=1))
        return 0
    if args.encode_check:
        print(json.dumps(encode_check(Path(args.profile), Path(args.profile_cpu_preprocess), args.runs), indent=1))
        return 0
    if args.mps_fit:
        fit = mps_fit(Path(args.profile), Path(args.profile_cpu_preprocess), args.runs, args.held_out, args.host_loop,
                      stages=args.fit_stages, door=args.fit_door, max_rate=args.fit_max_rate)
        if args.write_profile:
            fit["written"] = write_mps(fit, [Path(args.profile), Path(args.profile_cpu_preprocess)], args.runs)
        print(json.dumps(fit, indent=1))
        plot_mps_fit(fit, Path(args.plot or REPO / "docs" / "img" / "twin_mps_fit.png"))
        return 0
    if args.measure or args.measure_path:
        if not args.out:
            p.error("--measure and --measure-path need --out")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rc = measure(Path(args.out), args.size, args.requests) if args.measure else 0
        return rc or (measure_path(Path(args.out), args.size, Path(args.profile)) if args.measure_path else 0)
    if args.calibrate_path:
        print(json.dumps(calibrate_path(Path(args.calibrate_path), Path(args.profile),
                                        Path(args.profile_cpu_preprocess)), indent=1))
        return 0
    rep = report(Path(args.profile), Path(args.profile_cpu_preprocess), args.runs, args.host_loop, args.lengths)
    print(json.dumps(rep, indent=1))
    plot(rep, Path(args.plot or REPO / "docs" / "img" / "twin_agreement.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
