"""Reliability figures from a live `easerve serve` (file discovery, sim engine): overload, chaos, bad input.

    python benchmarks/reliability.py [--spec examples/llava-v1.6-34b.yaml] [--phase all|overload|chaos|badinput]
                                     [--seconds 120] [--speedup 1] [--out benchmarks/out/reliability]

- capacity: the completion rate while the deployment is driven at 2x its profile's saturation rate
  for ``--probe-seconds`` (what this machine sustains; the admission queue refuses the rest);
- overload: ``--seconds`` at 80 % of that capacity, then ``--seconds`` at 3x: every response must be a
  completion or a 429/503 with Retry-After, no other 5xx; accepted P99 TTFT at 3x over that at 80 %;
- chaos: per process kind (frontend, encode, local prefill, prefill, decode), SIGKILL one process at
  ``--kill-at`` s into ``--chaos-seconds`` of load at 60 % of capacity: requests lost silently (no
  response, no error, within the client timeout), explicit errors returned, time until every
  request sent from then on completes (the launcher restarts the killed process);
- bad input: 10 MB prompts sent while valid requests run at 50 % of capacity: their refusal
  latency, and the valid requests' TTFT with and without them.

Prints JSON and writes reliability.json (+ reliability.png) to --out. Timings are from a shared
2-core machine unless you say otherwise: compare ratios, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from easerve_runtime.api import load_manifest  # noqa: E402
from easerve_runtime.bench.load import Outcome, run_load  # noqa: E402
from easerve_runtime.profiles.capacity import saturation_rps  # noqa: E402
from easerve_runtime.workers.launcher import free_port  # noqa: E402
from easerve_runtime.workload import generate  # noqa: E402

KINDS = ("frontend", "encode", "local-prefill", "prefill", "decode")
CLIENT_TIMEOUT_S = 180.0


class Serve:
    """`easerve serve -f SPEC` in its own process group, with its processes.json."""

    def __init__(self, spec: str, speedup: float, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        env = dict(os.environ, EASERVE_SIM_SPEEDUP=str(speedup), EASERVE_SIM_BYTES_SCALE="0.01")
        env["PYTHONPATH"] = f"{ROOT / 'runtime'}:{ROOT / 'operator'}"
        cmd = [sys.executable, "-m", "easerve_runtime.cli.serve", "-f", spec, "--port", str(self.port)]
        cmd += ["--workdir", str(workdir)]
        self.log = workdir.parent / f"{workdir.name}-serve.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while "serving at" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.5)

    def processes(self) -> list[dict[str, Any]]:
        return list(json.loads((self.workdir / "processes.json").read_text())["processes"])

    def stop(self) -> float:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return time.monotonic() - t0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def classify(o: Outcome) -> str:
    """completed | refused (429/503 with Retry-After) | error (explicit) | lost (no answer in time)."""
    rec = o.record
    if rec.ok:
        return "completed"
    if o.status in (429, 503) and o.retry_after:
        return "refused"
    if rec.error and rec.error.startswith("client timeout"):
        return "lost"
    return "error"


def load(url: str, spec: Any, rate: float, seconds: float, seed: int) -> tuple[list[Outcome], float]:
    n = max(1, int(rate * seconds))
    reqs = generate(spec, rate, n, seed)
    return asyncio.run(run_load(url, reqs, timeout_s=CLIENT_TIMEOUT_S))


def summary(outs: list[Outcome], duration: float) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for o in outs:
        k = classify(o)
        kinds[k] = kinds.get(k, 0) + 1
    ttft = [o.record.first_token_s - o.record.arrival_s for o in outs if o.record.ok and o.record.first_token_s]
    other_5xx = sum(1 for o in outs if o.status is not None and o.status >= 500 and classify(o) != "refused")
    no_retry_after = sum(1 for o in outs if o.status in (429, 503) and not o.retry_after)
    errors: dict[str, int] = {}
    for o in outs:
        if classify(o) in ("error", "lost"):
            key = (o.record.error or "")[:100]
            errors[key] = errors.get(key, 0) + 1
    return {
        "sent": len(outs),
        "duration_s": round(duration, 1),
        **kinds,
        "completed_per_s": round(kinds.get("completed", 0) / duration, 3) if duration > 0 else None,
        "other_5xx": other_5xx,
        "refusals_without_retry_after": no_retry_after,
        "ttft_p50_s": _r(pct(ttft, 0.5)),
        "ttft_p99_s": _r(pct(ttft, 0.99)),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def recovery_s(outs: list[Outcome], k: float) -> float | None:
    """Seconds from the kill ``k`` to the first request from which on every request sent completed
    (or was refused 429 for a full queue: a load decision, not the fault). 0 if none failed."""
    after = sorted((o for o in outs if o.record.arrival_s >= k), key=lambda o: o.record.arrival_s)

    def fine(o: Outcome) -> bool:
        return o.record.ok or o.status == 429

    for j in range(len(after)):
        if all(fine(o) for o in after[j:]):
            return after[j].record.arrival_s - k
    return None


def overload(args: argparse.Namespace, spec: Any, serve: Serve) -> dict[str, Any]:
    profile_c = saturation_rps(spec) * args.speedup
    outs, dur = load(serve.url, spec, 2 * profile_c, args.probe_seconds, 1)
    probe = summary(outs, dur)
    capacity = max(probe["completed_per_s"] or 0.0, 0.05)
    time.sleep(10)
    at80 = summary(*load(serve.url, spec, 0.8 * capacity, args.seconds, 2))
    time.sleep(10)
    at3x = summary(*load(serve.url, spec, 3.0 * capacity, args.seconds, 3))
    ratio = at3x["ttft_p99_s"] / at80["ttft_p99_s"] if at3x["ttft_p99_s"] and at80["ttft_p99_s"] else None
    return {
        "profile_capacity_req_s": round(profile_c, 3),
        "probe_at_2x_profile": probe,
        "measured_capacity_req_s": round(capacity, 3),
        "at_80pct": at80,
        "at_3x": at3x,
        "accepted_p99_ttft_ratio_3x_over_80pct": _r(ratio),
    }


async def _strike_under_load(url: str, reqs: list[Any], pid: int, kill_at: float) -> tuple[list[Outcome], float, float]:
    """Run the load and SIGKILL ``pid`` ``kill_at`` s after its start; the kill time on the load's clock."""
    started: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    killed: list[float] = []

    async def strike() -> None:
        t0 = await started
        await asyncio.sleep(max(0.0, kill_at - (time.monotonic() - t0)))
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic() - t0)

    task = asyncio.create_task(strike())
    outs, dur = await run_load(url, reqs, timeout_s=CLIENT_TIMEOUT_S, on_start=started.set_result)
    await task
    return outs, dur, killed[0]


def chaos(args: argparse.Namespace, spec: Any, serve: Serve, capacity: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for i, kind in enumerate(KINDS):
        victims = [p for p in serve.processes() if p["stage"] == kind]
        if not victims:
            rows[kind] = {"skipped": "no such process in this deployment"}
            continue
        victim = victims[0]
        rate = 0.6 * capacity
        n = max(1, int(rate * args.chaos_seconds))
        reqs = generate(spec, rate, n, 100 + i)
        outs, dur, k = asyncio.run(_strike_under_load(serve.url, reqs, victim["pid"], args.kill_at))
        recovered = recovery_s(outs, k)
        s = summary(outs, dur)
        restarted = next(p for p in serve.processes() if p["stage"] == kind and p["index"] == victim["index"])
        rows[kind] = {
            "sent": s["sent"],
            "completed": s.get("completed", 0),
            "explicit_errors": s.get("error", 0),
            "refused_429_503": s.get("refused", 0),
            "lost_silently": s.get("lost", 0),
            "recovery_s": _r(recovered),
            "restarted_as_new_pid": restarted["pid"] != victim["pid"],
            "errors": s["errors"],
        }
        time.sleep(15)  # let the restarted process register before the next kind
    rows["partition-controller"] = partition_chaos(args, spec, serve, capacity)
    return rows


def partition_chaos(args: argparse.Namespace, spec: Any, serve: Serve, capacity: float) -> dict[str, Any]:
    """`easerve serve` runs no partition controller (a pod runs one per encode GPU), so start one
    for GPU 0 on the run's shm records, SIGKILL it under load, and restart it as the kubelet would."""
    shm = serve.workdir / "shm"
    cmd = [sys.executable, "-m", "easerve_operator.cli", "partition-controller", "--config", str(serve.workdir / "config.json")]
    cmd += ["--gpu", "0", "--total-sms", "142", "--shm-dir", str(shm), "--tick-ms", "5", "--sample-ms", "200"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'runtime'}:{ROOT / 'operator'}")

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)

    ctl = start()
    time.sleep(5)
    if ctl.poll() is not None:
        return {"skipped": f"partition controller exited with {ctl.returncode} at start"}
    rate = 0.6 * capacity
    reqs = generate(spec, rate, max(1, int(rate * args.chaos_seconds)), 200)
    outs, dur, k = asyncio.run(_strike_under_load(serve.url, reqs, ctl.pid, args.kill_at))
    ctl.wait(5)
    t_restart = time.monotonic()
    ctl = start()  # the kubelet restarts the container
    time.sleep(3)
    alive = ctl.poll() is None
    ctl.terminate()
    ctl.wait(10)
    s = summary(outs, dur)
    return {
        "sent": s["sent"],
        "completed": s.get("completed", 0),
        "explicit_errors": s.get("error", 0),
        "refused_429_503": s.get("refused", 0),
        "lost_silently": s.get("lost", 0),
        "recovery_s": _r(recovery_s(outs, k)),
        "restarted_as_new_pid": alive,
        "note": "workers keep the last published split while no controller runs (the record stays in shm)",
        "restart_check_s": round(time.monotonic() - t_restart, 1),
        "errors": s["errors"],
    }


def badinput(args: argparse.Namespace, spec: Any, serve: Serve, capacity: float) -> dict[str, Any]:
    big = json.dumps(
        {"model": spec.served_model_name, "messages": [{"role": "user", "content": "x" * 10_000_000}]}
    ).encode()

    async def bigs(stop: asyncio.Event, times: list[float], statuses: list[int]) -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                t0 = time.monotonic()
                async with s.post(
                    f"{serve.url}/v1/chat/completions", data=big, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    statuses.append(r.status)
                times.append(time.monotonic() - t0)
                await asyncio.sleep(0.5)

    rate = 0.5 * capacity
    base = summary(*load(serve.url, spec, rate, args.badinput_seconds, 7))

    async def main() -> tuple[list[Outcome], float, list[float], list[int]]:
        stop = asyncio.Event()
        times: list[float] = []
        statuses: list[int] = []
        t = asyncio.create_task(bigs(stop, times, statuses))
        n = max(1, int(rate * args.badinput_seconds))
        outs, dur = await run_load(serve.url, generate(spec, rate, n, 7), timeout_s=CLIENT_TIMEOUT_S)
        stop.set()
        await t
        return outs, dur, times, statuses

    outs, dur, times, statuses = asyncio.run(main())
    with_big = summary(outs, dur)
    return {
        "big_prompts_sent": len(times),
        "big_prompt_statuses": sorted(set(statuses)),
        "big_prompt_refusal_ms_p50": _r(1e3 * (pct(times, 0.5) or 0)),
        "big_prompt_refusal_ms_max": _r(1e3 * max(times)) if times else None,
        "valid_without": base,
        "valid_with_10mb_prompts": with_big,
    }


def plot(result: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ov = result.get("overload")
    if ov:
        names = ["80 %", "3x"]
        rows = [ov["at_80pct"], ov["at_3x"]]
        comp = [r.get("completed", 0) for r in rows]
        ref = [r.get("refused", 0) for r in rows]
        err = [r.get("error", 0) + r.get("lost", 0) for r in rows]
        axes[0].bar(names, comp, label="completed")
        axes[0].bar(names, ref, bottom=comp, label="429/503 + Retry-After")
        axes[0].bar(names, err, bottom=[c + r for c, r in zip(comp, ref, strict=True)], label="other errors")
        axes[0].set_title("overload: responses by kind")
        axes[0].legend()
    ch = result.get("chaos")
    if ch:
        kinds = [k for k in ch if "skipped" not in ch[k]]
        axes[1].bar(kinds, [ch[k]["recovery_s"] or 0 for k in kinds])
        axes[1].set_ylabel("recovery (s)")
        axes[1].set_title("chaos: SIGKILL under load")
        axes[1].tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "examples" / "llava-v1.6-34b.yaml"))
    ap.add_argument("--phase", default="all", choices=["all", "overload", "chaos", "badinput", "partition"])
    ap.add_argument("--seconds", type=float, default=120.0, help="Length of the 80 %% and 3x runs.")
    ap.add_argument("--probe-seconds", type=float, default=60.0)
    ap.add_argument("--chaos-seconds", type=float, default=60.0)
    ap.add_argument("--kill-at", type=float, default=20.0)
    ap.add_argument("--badinput-seconds", type=float, default=40.0)
    ap.add_argument("--capacity", type=float, default=None, help="Skip the probe: use this capacity (req/s).")
    ap.add_argument("--speedup", type=float, default=1.0, help="EASERVE_SIM_SPEEDUP of the sim engine.")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "reliability"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, spec = load_manifest(args.spec)
    wd = Path(tempfile.mkdtemp(prefix="easerve-rel-")) / "wd"
    serve = Serve(args.spec, args.speedup, wd)
    result: dict[str, Any] = {"spec": args.spec, "speedup": args.speedup, "cpus": os.cpu_count()}
    result["load_avg_at_start"] = os.getloadavg()
    try:
        capacity = args.capacity
        if args.phase in ("all", "overload"):
            result["overload"] = overload(args, spec, serve)
            capacity = result["overload"]["measured_capacity_req_s"]
        if capacity is None:
            capacity = saturation_rps(spec) * args.speedup
        if args.phase in ("all", "badinput"):
            result["bad_input"] = badinput(args, spec, serve, capacity)
        if args.phase in ("all", "chaos"):
            result["chaos"] = chaos(args, spec, serve, capacity)
        if args.phase == "partition":
            result["chaos"] = {"partition-controller": partition_chaos(args, spec, serve, capacity)}
    finally:
        result["serve_stop_after_sigterm_s"] = round(serve.stop(), 2)
        result["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    (out / "reliability.json").write_text(json.dumps(result, indent=1))
    plot(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
