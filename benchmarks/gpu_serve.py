"""End to end on a GPU: EAServe and a Dynamo-style configuration, each served by ``easerve serve``
on the torch engine, loaded by ``easerve bench`` at a ladder of rates; goodput per SLO tier.

What runs is the product: the launcher starts the topology's processes (frontend, encode with its
local prefill in the same process, partition controller, prefill, decode) over Dynamo's runtime (file discovery, TCP request
plane), each stage on the transformers engine of a LLaVA-NeXT 7B directory (CLIP ViT-L/336 +
a Mistral-7B-shaped backbone, ``easerve model init --size 7b``: the real config, tokenizer,
processor and chat template; random weights materialised at load). The client sends photo-like
JPEGs (``--image-format jpeg``) at the workload's image sizes.

Systems (``--systems``), on the same GPUs and the same engine:

- ``easerve``: micro-batched encode (Poisson-gap dispatch, B = 8, 50 ms max age) with nvJPEG and
  the processor on the GPU, every prefill local on the encode GPU (s = 0) under the dynamic SM
  split, one decode worker. Allocation E1 P0 D1.
- ``dynamo-style``: what Dynamo's EPD example does: pass-through encode (batch 1, dispatched at
  once, image decode and processor on the CPU: ``spec.encode.preprocessing: cpu``), every prefill remote
  (s = 1), one decode worker. Allocation E1 P1 D1.
- ``aggregated``: the vLLM-style baseline on the same engine (``spec.mode: aggregated``): one engine
  per GPU doing encode, prefill and decode in one loop with continuous batching, iterations within
  a token budget (``--token-budget``, default 2048). The torch engine prefills whole prompts (no
  chunking: docs/engine.md), and runs the prefill and the decode step as two forwards per iteration.
  As many engines as the easerve system's allocation places on this host's GPUs
  (``--aggregated-gpus`` overrides): one on a one-GPU host.
- ``easerve:ALLOC:bB:sS`` and ``dynamo-style:ALLOC``: either system at another point of HAS's
  space (allocation; for EAServe also B and s), e.g. ``easerve:e1p1d1:b4:s0.5``; the grammar is
  ``gpu_systems.py``'s. Each name's spec goes through the spec model before anything starts.

The topology's GPUs are placed on the host's GPUs in order and wrap when the host has fewer
(``easerve serve`` sets ``CUDA_VISIBLE_DEVICES`` per process): on one H200 every process of a
system shares that GPU, so both systems get the same silicon. Say which in the results: the JSON
records ``host_gpus``.

SLO tiers scaled to this model: the five tiers of the examples (2/4/8/16/32 s TTFT, 60-250 ms
TPOT) divided by ``--slo-scale`` (default 4: a 7B backbone on an H200 is about 4x faster per
token than the 34B on the RTX 6000 Ada that the example tiers were set for).

    # on the GPU machine (see benchmarks/make_devsite.sh for .devsite, made on the dev machine)
    bash benchmarks/devsite.sh && PYTHONPATH=.devsite/site:.devsite:runtime:operator \\
        python3 benchmarks/gpu_serve.py --out $OUT --rates 1,2,4,6 --requests 60
    # anywhere: print the committed runs' summary
    python benchmarks/gpu_serve.py --summary

Writes ``gpu_serve.json`` after every point (a run cut short keeps what it measured) and
``gpu_serve.png``; per-system serve logs go to ``--out/<system>/``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from easerve_runtime.bench.payloads import PROMPT_FILLER  # noqa: E402
from easerve_runtime.workers.launcher import MPS_SHARES_ENV, mps_shares  # noqa: E402
from gpu_systems import SYSTEMS, parse  # noqa: E402  (SYSTEMS: the fixed systems, re-exported)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ENGINE_PROFILE = RESULTS / "engine_profile_h200_llava7b_run12.json"
ENGINE_PROFILE_CPU_PRE = RESULTS / "engine_profile_h200_llava7b_cpu_preprocess_run12.json"
"""The served spec's latency profile from run 12 on (``--profile-file``): this engine's own, measured
on the H200 (``twin_agreement.py --measure``, calibrated at zero load), with the CPU-preprocessing
encode points for the Dynamo-style systems. The frontend sizes its admission queue from the
profile's capacity; runs 1-10 served with the shipped ``llava-v1.6-34b@h200`` (a 34B backbone's
capacity: 7 places for EAServe at 5.5 req/s, which refused 28 of 300 requests in run 10)."""
STATS_SETTLE_S = 2.5  # > the decode worker's statistics period: the point's last steps are written
TIERS = (("strict", 2, 60), ("tight", 4, 80), ("moderate", 8, 100), ("loose", 16, 150), ("relaxed", 32, 250))



def log(msg: str) -> None:
    print(f"[gpu_serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def aggregated_gpus(host_gpus: int) -> int:
    """The GPUs the easerve system's allocation spans on this host (its GPUs wrap on a smaller host)."""
    easerve = sum(v["replicas"] for v in SYSTEMS["easerve"]["allocation"].values())
    return max(1, min(easerve, host_gpus))


def spec_doc(system: str, model_dir: Path, slo_scale: float, kv_fraction: float, token_budget: int = 2048,
             gpus: int = 1, profile_file: Path | None = None) -> dict[str, Any]:
    """The spec ``system`` is served with; its latency profile is ``profile_file`` when given, else
    the shipped ``llava-v1.6-34b@h200`` (runs 1-10)."""
    sys_ = parse(system)  # refuses a name it does not know, naming the wrong part
    tiers = [
        {"name": n, "ttftSeconds": round(t / slo_scale, 3), "tpotMs": round(p / slo_scale, 2)} for n, t, p in TIERS
    ]
    placement = sys_.placement(token_budget, gpus)
    doc = {
        "apiVersion": "easerve.io/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": f"gpu-{sys_.slug}"},
        "spec": {
            "model": {
                "name": "llava-next-7b-random",
                "modality": "image",
                "encoder": "clip-vit-l-336",
                "path": str(model_dir),
                "randomWeights": True,
            },
            "engine": ({"backend": "torch", "profileFile": str(profile_file)} if profile_file is not None
                       else {"backend": "torch", "profile": "llava-v1.6-34b@h200"}),
            "decode": {"kvMemoryFraction": kv_fraction},
            **placement,
            "slo": {"objective": "moderate", "tiers": tiers},
            "discovery": {"backend": "file"},
        },
    }
    if sys_.candidate is not None:  # a point of HAS's space: B, s and the SM split as HAS deploys them
        from easerve_operator.tuning.space import apply_candidate
        from easerve_runtime.api import parse_spec

        spec = apply_candidate(parse_spec(doc["spec"]), sys_.candidate)
        for key, value in (("encode", spec.encode), ("offload", spec.offload), ("smPartition", spec.sm_partition)):
            doc["spec"][key] = value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return doc


def served_profile(system: str, workdir: Path, profile: str) -> Path | None:
    """The profile file ``system`` is served with (None: the shipped one): ``profile``, with the
    CPU-preprocessing run's encode points for a system that preprocesses on the CPU (the twin's
    choice, ``twin_agreement.system_profile``), written into ``workdir``."""
    if not profile:
        return None
    import twin_agreement

    main = Path(profile).resolve()
    return twin_agreement.system_profile(system, workdir, main, twin_agreement.cpu_preprocess_of(main))


def model_dir(out: Path, size: str) -> Path:
    from easerve_runtime.models.init import init_model

    d = out / f"llava-next-{size}"
    if not (d / "config.json").exists():
        log(f"easerve model init llava-next --size {size} -> {d}")
        init_model("llava-next", d, size=size, weights=size == "tiny")
    return d


class Serve:
    """``easerve serve -f spec`` as a child process group; ready when its log says it serves."""

    def __init__(self, spec_path: Path, workdir: Path, port: int, env: dict[str, str]) -> None:
        self.log_path = workdir / "serve.log"
        workdir.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "easerve_operator.cli", "serve", "-f", str(spec_path), "--port", str(port),
                 "--workdir", str(workdir / "wd")],
                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if "serving at" in text:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"easerve serve exited {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(1)
        raise TimeoutError(f"easerve serve not ready in {timeout:.0f} s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


GPU_CLIENT = ("--image-format", "jpeg", "--ignore-eos")
"""The GPU runs' client: photo-like JPEGs, as real clients send, and every asked-for token decoded
(random weights). The CPU benchmarks of the sim engine send the default images, a connection per
request, as a cluster trial's load Job does (``SIM_CLIENT``)."""
SIM_CLIENT = ("--connection-per-request",)


def bench_point(url: str, spec_path: Path, rate: float, n: int, seed: int, env: dict[str, str],
                client: tuple[str, ...] = GPU_CLIENT) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", url, "-f", str(spec_path), "--rate", str(rate),
           "--requests", str(n), "--seed", str(seed), *client, "--json", "--timeout", "120"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=n / rate + 300)
    try:  # exit 1 = some requests failed: the report says which and why, and it counts
        return dict(json.loads(r.stdout))
    except json.JSONDecodeError:
        raise RuntimeError(f"easerve bench failed ({r.returncode}): {r.stderr[-2000:]}") from None


def decode_stats(directory: Path) -> dict[str, Any]:
    """The decode workers' cumulative counters (``$EASERVE_DECODE_STATS``), summed over processes."""
    tot: dict[str, Any] = {"loop": {}, "engine": {}}
    for f in sorted(directory.glob("decode-*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for part in ("loop", "engine"):
            for k, v in (doc.get(part) or {}).items():
                if isinstance(v, dict):
                    h = tot[part].setdefault(k, {})
                    for b, c in v.items():
                        h[b] = h.get(b, 0) + c
                elif isinstance(v, (int, float)):
                    tot[part][k] = tot[part].get(k, 0) + v
    return tot


def decode_breakdown(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where the decode loop's time went during one point: per step, the engine's wall time, the
    GPU time of the forward and of sampling (CUDA events), the host rest; per admission, its wall
    time and how it was loaded."""
    def d(part: str, k: str) -> float:
        return float(after[part].get(k, 0)) - float(before[part].get(k, 0))

    steps = d("engine", "steps")
    if steps <= 0:
        return {}
    admits = d("engine", "admits")
    iters = max(1.0, d("loop", "iterations"))
    out = {
        "steps": int(steps),
        "rows_per_step": round(d("engine", "rows") / steps, 2),
        "engine_step_ms": round(1e3 * d("engine", "step_s") / steps, 2),
        "forward_gpu_ms": round(d("engine", "forward_ms") / steps, 2),
        "sample_gpu_ms": round(d("engine", "sample_ms") / steps, 3),
        "loop_iteration_ms": round(1e3 * d("loop", "step_s") / iters, 2),
        "loop_admit_ms_per_iteration": round(1e3 * d("loop", "admit_s") / iters, 3),
        # from reaching the decode worker to joining its batch (KV taken and received, the wait for
        # a slot and the step boundary), per admitted request
        "handoff_ms": round(1e3 * d("loop", "handoff_s") / max(1.0, d("loop", "admitted")), 2),
        "loop_busy_s": round(d("loop", "loop_s") - d("loop", "idle_s"), 2),
        "admits": int(admits),
        "admit_ms": round(1e3 * d("engine", "admit_s") / admits, 2) if admits else None,
        "admit_wait_ms": round(1e3 * d("engine", "admit_wait_s") / admits, 2) if admits else None,
        "admit_unstaged": int(d("engine", "admit_unstaged")),
        "staged": int(d("engine", "staged")),
        "stage_ms": round(1e3 * d("engine", "stage_s") / max(1.0, d("engine", "staged")), 1),
        # same-GPU handoffs by CUDA IPC (engines.kv_ipc): mapped, copied device to device, unmapped
        "ipc_opened": int(d("engine", "ipc_opened")),
        "ipc_open_ms": round(1e3 * d("engine", "ipc_open_s") / max(1.0, d("engine", "ipc_opened")), 2),
        "release_ms": round(1e3 * d("engine", "release_s") / max(1.0, d("engine", "releases")), 3),
        "captures": int(d("engine", "captures")),
        "capture_s": round(d("engine", "capture_s"), 2),
    }
    for phase in ("encode", "prefill", "decode"):  # the aggregated worker's iteration, per phase
        if f"{phase}_s" in after["loop"]:
            out[f"loop_{phase}_ms_per_iteration"] = round(1e3 * d("loop", f"{phase}_s") / iters, 2)
            out[f"loop_{phase}_s"] = round(d("loop", f"{phase}_s"), 4)  # the totals: twin_agreement --calibrate-aggregated
            out["loop_iterations"] = int(iters)
    for h in ("kv_len", "batch_bucket"):
        a, b = after["engine"].get(h, {}), before["engine"].get(h, {})
        out[h] = {k: v - b.get(k, 0) for k, v in sorted(a.items(), key=lambda kv: int(kv[0])) if v - b.get(k, 0)}
    out["host_ms_per_step"] = round(out["engine_step_ms"] - out["forward_gpu_ms"] - out["sample_gpu_ms"], 2)
    return out


ENCODE_SERIES = {
    "easerve_encode_batch_size_count": "batches",
    "easerve_encode_batch_size_sum": "requests",
    "easerve_encode_items_total": "items",
    "easerve_encode_batch_seconds_sum": "engine_s",
    "easerve_encode_profile_seconds_total": "profile_s",
    "easerve_encode_queue_wait_seconds_sum": "queue_wait_s",
    "easerve_encode_queue_wait_seconds_count": "queue_waits",
}
"""The encode workers' own series that a point's ``encode`` block is the difference of."""


def _samples(workdir: Path, stage: str | None = None) -> Iterator[Any]:
    """Every sample of the ``/metrics`` of the run's processes (the Dynamo system port in
    ``processes.json``), of those of ``stage`` only when given; a process that does not answer is
    skipped, and a run with no ``processes.json`` yields nothing."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        procs = json.loads((workdir / "wd" / "processes.json").read_text())["processes"]
    except (OSError, ValueError, KeyError):
        return
    for p in procs:
        if (stage is not None and p.get("stage") != stage) or not p.get("system_port"):
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{p['system_port']}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        for fam in text_string_to_metric_families(text):
            yield from fam.samples


def worker_metrics(workdir: Path, stage: str = "encode") -> dict[str, float]:
    """The encode workers' counters summed over the replicas of ``stage``. Empty when none answers.

    Why: the decode loop writes its own statistics, but what a request spent before its first
    token (the batcher's wait, the encoder's time per micro-batch against its profile) was not
    in the points, so a TTFT the twin misses could not be placed (run 16, docs/benchmarks.md)."""
    out: dict[str, float] = {}
    for sample in _samples(workdir, stage):
        if sample.name in ENCODE_SERIES:
            key = ENCODE_SERIES[sample.name]
        elif sample.name == "easerve_encode_dispatch_total":
            key = f"dispatch_{sample.labels.get('reason', '?')}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(sample.value)
    return out


PREFILL_SERIES = {
    "easerve_prefill_batches_total": "batches",
    "easerve_prefill_batch_requests_total": "requests",
    "easerve_prefill_engine_seconds_total": "engine_s",
    "easerve_prefill_profile_seconds_total": "profile_s",
    "easerve_prefill_queue_wait_seconds_total": "queue_wait_s",
}
"""The prefill workers' own series (remote ``prefill`` and ``local-prefill``, by their ``stage``
label), which a point's ``prefill`` block is the difference of."""
KV_HANDOFF_SERIES = {"easerve_kv_handoff_seconds_sum": "kv-handoff/s", "easerve_kv_handoff_seconds_count": "kv-handoff/n"}
"""The prefill side of each request's KV handoff (the cache copied to the host and put where its
decode worker takes it, after the first token is out): a point's ``prefill["kv-handoff"]``."""


def prefill_metrics(workdir: Path) -> dict[str, float]:
    """The prefill series of every process of the run (a local prefill hosted in an encode process
    reports there), summed per ``stage`` label: keys ``<stage>/<name>``.

    Why: run 17's encode counters showed the twin charges the encoder as measured, yet its TTFT p50
    read 1.4-1.85x the GPU's; what lies between the encoder and the first token had no counter."""
    out: dict[str, float] = {}
    for sample in _samples(workdir):
        if sample.name in PREFILL_SERIES:
            key = f"{sample.labels.get('stage', '?')}/{PREFILL_SERIES[sample.name]}"
        elif sample.name in KV_HANDOFF_SERIES:
            key = KV_HANDOFF_SERIES[sample.name]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def prefill_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One point's prefill workers per stage from two ``prefill_metrics`` reads: batches, requests
    per batch, the engine's time per batch against the profile's for the same batches, the queue wait."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out: dict[str, Any] = {}
    if d.get("kv-handoff/n", 0.0) > 0:
        n = d["kv-handoff/n"]
        out["kv-handoff"] = {"handoffs": int(n), "ms_mean": round(d.get("kv-handoff/s", 0.0) / n * 1e3, 2)}
    for stage in sorted({k.split("/", 1)[0] for k in d} - {"kv-handoff"}):
        n = d.get(f"{stage}/batches", 0.0)
        if n <= 0:
            continue
        reqs = d.get(f"{stage}/requests", 0.0)
        row: dict[str, Any] = {"batches": int(n), "requests": int(reqs), "requests_per_batch": round(reqs / n, 2),
                               "engine_ms_per_batch": round(d.get(f"{stage}/engine_s", 0.0) / n * 1e3, 2),
                               "profile_ms_per_batch": round(d.get(f"{stage}/profile_s", 0.0) / n * 1e3, 2)}
        if d.get(f"{stage}/profile_s"):
            row["engine_over_profile"] = round(d[f"{stage}/engine_s"] / d[f"{stage}/profile_s"], 3)
        if reqs:
            row["queue_wait_ms_mean"] = round(d.get(f"{stage}/queue_wait_s", 0.0) / reqs * 1e3, 2)
        out[stage] = row
    return out


def encode_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One point's encode stage from two ``worker_metrics`` reads: micro-batches, their mean size,
    the engine's time per batch against what the served profile predicts for the same batches, and
    the batcher's mean wait."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("batches", 0.0)
    if n <= 0:
        return {}
    out: dict[str, Any] = {"batches": int(n), "requests": int(d.get("requests", 0.0)), "requests_per_batch": round(d.get("requests", 0.0) / n, 2),
                           "items_per_batch": round(d.get("items", 0.0) / n, 2),
                           "engine_ms_per_batch": round(d.get("engine_s", 0.0) / n * 1e3, 2),
                           "profile_ms_per_batch": round(d.get("profile_s", 0.0) / n * 1e3, 2),
                           "dispatch": {k.removeprefix("dispatch_"): int(v) for k, v in d.items()
                                        if k.startswith("dispatch_") and v}}
    if d.get("profile_s"):
        out["engine_over_profile"] = round(d["engine_s"] / d["profile_s"], 3)
    if d.get("queue_waits"):
        out["queue_wait_ms_mean"] = round(d["queue_wait_s"] / d["queue_waits"] * 1e3, 2)
    return out


def gpu_info() -> dict[str, Any]:
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"host_gpus": torch.cuda.device_count(), "gpu": p.name, "sms": p.multi_processor_count}
    except ImportError:
        pass
    return {"host_gpus": 0, "gpu": "cpu"}


class MPS:
    """An MPS control daemon for this run (``--mps``): processes sharing a GPU then run their kernels
    concurrently instead of taking turns in time slices. Its pipe and log directories are private
    to the run, and it is told to quit at the end."""

    def __init__(self, out: Path) -> None:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(out / "mps-pipe"), "CUDA_MPS_LOG_DIRECTORY": str(out / "mps-log")}
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **self.env}, check=True, timeout=30)
        log("MPS control daemon started")

    def stop(self) -> None:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **self.env},
                       timeout=30, check=False)
        log("MPS control daemon stopped")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mps = MPS(out) if args.mps else None
    env = dict(mps.env) if mps else {}
    if args.mps_share:
        env[MPS_SHARES_ENV] = args.mps_share
    try:
        return _run(args, out, env)
    finally:
        if mps is not None:
            mps.stop()


def _run(args: argparse.Namespace, out: Path, extra_env: dict[str, str]) -> int:
    result_path = out / "gpu_serve.json"
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
    result.update({"bench": "gpu_serve", "measured": "gpu" if args.size != "tiny" else "cpu-smoke",
                   "model": f"llava-next-{args.size} (random weights)", "slo_scale": args.slo_scale,
                   "requests_per_point": args.requests, "mps": args.mps, **gpu_info(),
                   # the profile the pods read, whose capacity sizes the frontend's admission queue
                   # (twin_agreement.served_door_capacity); "": the shipped one the spec names
                   "served_profile": Path(args.profile_file).name if args.profile_file else "",
                   # what the prompts were made of (twin_agreement.prompt_filler_of: runs up to 32
                   # sent "lorem ", 3.3 tokens a workload token)
                   "prompt_filler": PROMPT_FILLER})
    if args.mps_share:
        result["mps_shares"] = mps_shares(args.mps_share)
    result.setdefault("systems", {})
    d = model_dir(out, args.size)
    deadline = time.monotonic() + args.budget_s
    port = 18000
    for system in args.systems.split(","):
        runs = result["systems"].setdefault(system, {"points": []})
        done = {p["rate"] for p in runs["points"]}
        rates = [r for r in args.rates if r not in done]
        if done & set(args.rates):  # resumed: say so, a repeat wants a fresh --out (run 33 lost one this way)
            log(f"{system}: rate(s) {sorted(done & set(args.rates))} already in {result_path}; not served again")
        if not rates:
            continue
        if time.monotonic() + args.requests / max(rates) + 30 > deadline:  # not even its fastest point fits
            log(f"{system}: budget spent before it started")
            runs["skipped"] = "budget"
            continue
        runs.pop("skipped", None)
        gpus = args.aggregated_gpus or aggregated_gpus(int(result.get("host_gpus") or 0))
        system_ = parse(system)
        workdir = out / system_.slug  # a plain directory name whatever the system's name
        workdir.mkdir(parents=True, exist_ok=True)
        doc = spec_doc(system, d, args.slo_scale, args.kv_fraction, args.token_budget, gpus,
                       served_profile(system, workdir, args.profile_file))
        runs["spec"] = doc["spec"]
        spec_path = workdir / "spec.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(doc, indent=1))
        stats_dir = workdir / "decode-stats"
        stats_dir.mkdir(parents=True, exist_ok=True)
        # a +mpsNN system runs under an MPS daemon of its own (unless the whole run has one, --mps)
        own_mps = MPS(workdir) if system_.mps is not None and "CUDA_MPS_PIPE_DIRECTORY" not in extra_env else None
        env = {**os.environ, **extra_env, "EASERVE_TORCH_MAX_LEN": str(args.max_len), **system_.env,
               **(own_mps.env if own_mps else {}), "EASERVE_DECODE_STATS": str(stats_dir)}
        if args.size == "tiny":
            env.update(EASERVE_DEVICE="cpu", OMP_NUM_THREADS="1")
        log(f"{system}: starting easerve serve")
        t0 = time.monotonic()
        port += 1
        srv = Serve(spec_path, workdir, port, env)
        try:
            srv.wait(args.start_timeout)
            runs["startup_s"] = round(time.monotonic() - t0, 1)
            log(f"{system}: serving after {runs['startup_s']} s")
            warm = bench_point(srv.url, spec_path, rates[0], min(8, args.requests), 99, env)  # not recorded
            runs["warmup"] = {k: warm.get(k) for k in ("completed", "failed", "errors", "ttft_mean")}
            for rate in rates:
                if time.monotonic() + args.requests / rate + 30 > deadline:
                    log(f"{system}: budget spent before rate {rate}")
                    break
                log(f"{system}: rate {rate} req/s, {args.requests} requests")
                time.sleep(0.5)  # the decode loop wrote its idle statistics
                before = decode_stats(stats_dir)
                enc_before = worker_metrics(workdir)
                pre_before = prefill_metrics(workdir)
                rep = bench_point(srv.url, spec_path, rate, args.requests, 1, env)
                time.sleep(STATS_SETTLE_S)
                loop = decode_breakdown(before, decode_stats(stats_dir))
                enc = encode_breakdown(enc_before, worker_metrics(workdir))
                pre = prefill_breakdown(pre_before, prefill_metrics(workdir))
                runs["points"].append({"rate": rate, **rep, "decode_loop": loop, "encode": enc, "prefill": pre})
                log(f"{system}: rate {rate}: encode {enc}")
                log(f"{system}: rate {rate}: prefill {pre}")
                log(f"{system}: rate {rate}: decode loop {loop}")
                g = rep.get("goodput", {})
                log(f"{system}: rate {rate}: throughput {rep.get('throughput')} goodput {g} "
                    f"ttft p99 {rep.get('ttft_p99')} failed {rep.get('failed')} {rep.get('errors')}")
                result_path.write_text(json.dumps(result, indent=1))
        except Exception as exc:  # noqa: BLE001 - record it, keep the other system's points
            runs["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            log(f"{system}: {runs['error']}")
        finally:
            srv.stop()
            if own_mps is not None:
                own_mps.stop()
            result_path.write_text(json.dumps(result, indent=1))
    plot(result, out / "gpu_serve.png")
    print(json.dumps(summarize([result]), indent=1))
    return 0


def goodput_of(point: dict[str, Any], tier: str) -> float:
    g = point.get("goodput") or {}
    v = g.get(tier) if isinstance(g, dict) else None
    return float(v or 0.0)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mean_tree(ds: list[dict[str, Any]]) -> dict[str, Any]:
    """``mean_of_repeats``'s figures: each number every repeat has is their mean; a dict of numbers
    (goodput per tier) is the mean key by key over the keys any repeat has (absent: 0); a dict of
    dicts (the workers' counters, ``encode.engine_over_profile``, ``prefill.prefill.…``) is averaged
    the same way, level by level; anything else is the first repeat's. Why level by level: the
    stage-scored MPS fit reads those counters, and a repeat's first file alone stood for all."""
    out = dict(ds[0])
    for k, v in ds[0].items():
        if k == "rate":
            continue
        if _is_number(v) and all(_is_number(d.get(k)) for d in ds):
            out[k] = sum(float(d[k]) for d in ds) / len(ds)
        elif isinstance(v, dict) and all(isinstance(d.get(k), dict) for d in ds):
            if all(_is_number(x) for x in v.values()):
                keys = set().union(*(d[k] for d in ds))
                out[k] = {t: sum(float(d[k].get(t, 0.0)) for d in ds) / len(ds) for t in sorted(keys)}
            else:
                out[k] = _mean_tree([d[k] for d in ds])
    return out


def mean_of_repeats(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One point from a point measured more than once (same system, same rate): every figure the
    summaries read (goodput per tier, throughput, TTFT and TPOT) is the mean over the repeats, and
    ``repeats`` keeps each one's moderate-tier goodput and where it came from.

    Why the mean and not a pick: run 15 repeated points at 7 and 8.5 req/s on one H200 and the
    same system moved from 5.51 to 6.52 req/s at 7, and by 3x at 8.5 (past saturation); keeping
    either alone would be a choice, refusing both would drop what was measured."""
    if len(points) == 1:
        return points[0]
    out = _mean_tree(points)
    out["repeats"] = [{"file": p.get("file"), "goodput_moderate": (p.get("goodput") or {}).get("moderate")}
                      for p in points]
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: goodput per tier at each rate, best-over-rates at the moderate tier; the ratios."""
    out: dict[str, Any] = {"runs": []}
    for res in results:
        systems = {}
        for name, s in res.get("systems", {}).items():
            pts = sorted(s.get("points", []), key=lambda p: p["rate"])
            tiers = sorted({t for p in pts for t in (p.get("goodput") or {})})
            systems[name] = {
                "goodput": {t: {str(p["rate"]): round(goodput_of(p, t), 3) for p in pts} for t in tiers},
                "throughput": {str(p["rate"]): p.get("throughput") for p in pts},
                "ttft_p99": {str(p["rate"]): p.get("ttft_p99") for p in pts},
                "tpot_mean": {str(p["rate"]): p.get("tpot_mean") for p in pts},
                "tpot_p99": {str(p["rate"]): p.get("tpot_p99") for p in pts},
                "best_moderate": round(max((goodput_of(p, "moderate") for p in pts), default=0.0), 3),
                **({"error": s["error"][:300]} if s.get("error") else {}),
            }
        ratios = {}
        if "easerve" in systems:
            for other in (n for n in systems if n != "easerve"):
                b = systems[other]["best_moderate"]
                ratios[f"easerve/{other}"] = round(systems["easerve"]["best_moderate"] / b, 2) if b else None
        keys = ("measured", "model", "gpu", "host_gpus", "mps", "requests_per_point", "slo_scale", "file")
        out["runs"].append({k: res.get(k) for k in keys} | {"systems": systems, "ratios": ratios})
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in result.get("systems", {}).items():
        pts = sorted(s.get("points", []), key=lambda p: p["rate"])
        if not pts:
            continue
        rates = [p["rate"] for p in pts]
        axes[0].plot(rates, [goodput_of(p, "moderate") for p in pts], marker="o", label=name)
        axes[1].plot(rates, [p.get("ttft_p99") or float("nan") for p in pts], marker="o", label=name)
    axes[0].set(xlabel="offered rate (req/s)", ylabel="goodput, moderate tier (req/s)",
                title=f"{result.get('model')} on {result.get('gpu')} x{result.get('host_gpus')}")
    axes[1].set(xlabel="offered rate (req/s)", ylabel="P99 TTFT (s)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output directory (on the GPU machine: $OUT)")
    p.add_argument("--systems", default="easerve,dynamo-style",
                   help="comma list of easerve, easerve-own-process, dynamo-style, aggregated, aggregated@TOKENS "
                        "(the aggregated baseline at that token budget: its sweep), and points of HAS's space: "
                        "easerve:ALLOC:bB:sS, dynamo-style:ALLOC (benchmarks/gpu_systems.py)")
    p.add_argument("--rates", default="1,2,4,6", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=60, help="requests per rate point")
    p.add_argument("--size", default="7b", choices=["tiny", "7b"], help="tiny: CPU smoke of the harness")
    p.add_argument("--slo-scale", type=float, default=4.0)
    p.add_argument("--kv-fraction", type=float, default=0.45, help="spec.decode.kvMemoryFraction")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--token-budget", type=int, default=2048,
                   help="aggregated: tokens per engine iteration, decode included (vLLM's max_num_batched_tokens)")
    p.add_argument("--aggregated-gpus", type=int, default=0,
                   help="aggregated: GPUs, one engine each (default: as many as the easerve system spans here)")
    p.add_argument("--start-timeout", type=float, default=400)
    p.add_argument("--profile-file", default=str(ENGINE_PROFILE),
                   help="the served spec's latency profile (the engine's measured one); '' for the shipped "
                        "llava-v1.6-34b@h200 that runs 1-10 used")
    p.add_argument("--budget-s", type=float, default=560, help="stop starting new points after this")
    p.add_argument("--mps", action="store_true", help="run the systems under an MPS daemon (one shared GPU)")
    p.add_argument("--mps-share", default="",
                   help="with --mps: stage=percent,... of the SMs each stage's processes may use "
                        "(EASERVE_MPS_SHARES, e.g. encode=50,prefill=50: decode keeps the rest free)")
    p.add_argument("--summary", action="store_true", help="print the summary of benchmarks/results/gpu_serve_*.json")
    args = p.parse_args()
    if args.summary:
        results = []
        for f in sorted(glob.glob(str(RESULTS / "gpu_serve_*.json"))):
            res = json.loads(Path(f).read_text())
            res["file"] = str(Path(f).relative_to(REPO))
            results.append(res)
        print(json.dumps(summarize(results), indent=1))
        return 0
    if not args.out:
        p.error("--out is required (or --summary)")
    if args.mps_share:
        if not args.mps:
            p.error("--mps-share needs --mps (without an MPS daemon the processes time-slice the GPU)")
        try:
            mps_shares(args.mps_share)
        except ValueError as exc:
            p.error(str(exc))
    for system in args.systems.split(","):
        try:
            refuse_unservable(spec_doc(system, Path(args.out) / "model", args.slo_scale, args.kv_fraction, args.token_budget,
                                 args.aggregated_gpus or 1))
        except ValueError as exc:
            p.error(str(exc))
    return run(args)


def refuse_unservable(doc: dict[str, Any]) -> None:
    """Raise ``ValueError`` with the spec model's own words when ``easerve serve`` would refuse ``doc``
    (e.g. a TP-2 pool on the torch engine): refused here, before a GPU second is spent on it."""
    from easerve_runtime.api import parse_spec
    from easerve_runtime.api import spec_errors as errors
    from pydantic import ValidationError

    try:
        parse_spec(doc["spec"])
    except ValidationError as exc:
        raise ValueError(f"--systems: {doc['metadata']['name']}: " + "; ".join(errors(exc))) from None


if __name__ == "__main__":
    sys.exit(main())
