"""One GPU-machine call: ``gpu_engine.py`` then ``gpu_serve.py``, their results under ``$OUT``.

Made for the device tool's limits (docs: .library/device): what comes back from ``$OUT`` is at most
8 files, two folders deep, so ``gpu_serve`` runs in ``/tmp/gs`` (its specs, logs and model
directory stay there) and only its JSON and plot are copied to ``$OUT``, every few seconds as well
as at the end (a call cut off at its limit still returns the points it measured). Also written:
``engine.log``, ``serve.log`` and ``warn.txt`` (the distinct warning and error lines of every
process that ``easerve serve`` started, counted), 7 files with ``gpu_engine.json`` and ``.png``.

    # on the GPU machine, from the repository root, .devsite carried (benchmarks/make_devsite.sh)
    python3 benchmarks/gpu_run.py --engine "--only encode decode decode_load --profile" \\
        --serve "--systems easerve,dynamo-style --rates 1,2.5,5 --requests 40" 2>&1 | tee $OUT/log

Either side may be left out (``--engine ""``). Each runs under its own time limit
(``--engine-timeout``, ``--serve-timeout``) so the whole call ends inside the device's 10 minutes.

``--plan FILE`` runs a planned GPU call instead of ``--serve``: a JSON file (``benchmarks/plans/``)
that names, per card, the profile the pods read and a list of ``gpu_serve`` invocations (jobs).
The card is picked by its name in ``nvidia-smi -L`` (the device may lend an H100 where an H200
was asked for), and the jobs share one budget (``--budget-s``): each gets what is left, and one
whose fastest point no longer fits is skipped and said so, not started. Each job's JSON comes back
as ``gpu_serve_<job>.json`` as it grows. A job runs in ``/tmp/gs/<job>``: on a machine still warm
from a call that was cut off, its points already served are kept, not served again (``gpu_serve``'s
resume rule), so the same plan called again finishes it. Why it is committed: run 34's hand-written driver gave
two invocations a budget smaller than one point and served nothing for them.

    python3 benchmarks/gpu_run.py --plan benchmarks/plans/run35.json      # GPU machine, .devsite carried
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SERVE_DIR = Path("/tmp/gs")


def say(msg: str) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy_serve(out: Path, serve_dir: Path = SERVE_DIR, suffix: str = "", names: tuple[str, ...] = ("gpu_serve.json", "gpu_serve.png")) -> None:
    for name in names:
        f = serve_dir / name
        if f.exists():
            stem, dot, ext = name.partition(".")
            with contextlib.suppress(OSError):
                shutil.copyfile(f, out / f"{stem}{suffix}{dot}{ext}")


STARTUP_S = 30.0
"""What a job needs beyond its fastest point before it is worth starting: ``easerve serve``'s start
(about 20 s on the H100s and H200s of runs 28-34) and the warm-up requests."""


def card_plan(plan: dict[str, Any], gpu_name: str) -> dict[str, Any]:
    """The plan's entry for this card: the first whose ``match`` is in the GPU's name."""
    for card in plan["cards"]:
        if card["match"].lower() in gpu_name.lower():
            return card
    raise ValueError(f"plan: no card matches {gpu_name!r} (matches: {[c['match'] for c in plan['cards']]})")


def job_seconds(job: dict[str, Any], requests: int) -> float:
    """The least a job needs to serve one point: its start, then its fastest rate's requests and the
    30 s that ``gpu_serve`` itself keeps in hand before starting a point."""
    rates = [float(r) for r in str(job["rates"]).split(",")]
    return STARTUP_S + requests / max(rates) + 30.0


def job_argv(card: dict[str, Any], job: dict[str, Any], requests: int, budget_s: float, serve_dir: Path) -> list[str]:
    """``gpu_serve.py``'s arguments for one job, under what is left of the call's budget."""
    argv = ["--out", str(serve_dir / job["name"]), "--requests", str(requests), "--profile-file", card["profile"],
            "--budget-s", f"{budget_s:.0f}", "--rates", str(job["rates"]), "--systems", ",".join(job["systems"])]
    return argv + [str(a) for a in job.get("args", [])]


def run_plan(plan: dict[str, Any], gpu_name: str, budget_s: float, serve: Any, clock: Any = time.monotonic) -> list[dict[str, Any]]:
    """Run the card's jobs in order under one budget; ``serve(job, argv, left_s)`` runs one. Returns
    what became of each job (served, or skipped with the seconds it needed and had)."""
    card = card_plan(plan, gpu_name)
    requests = int(plan.get("requests", 300))
    deadline = clock() + budget_s
    done = []
    for job in card["jobs"]:
        left = deadline - clock()
        need = job_seconds(job, requests)
        if left < need:
            say(f"job {job['name']}: skipped, needs {need:.0f} s and {left:.0f} s are left")
            done.append({"job": job["name"], "skipped": "budget", "need_s": round(need), "left_s": round(left)})
            continue
        say(f"job {job['name']}: rates {job['rates']}, {len(job['systems'])} systems, {left:.0f} s left")
        # gpu_serve's own budget keeps half the start margin back for the last system's teardown
        rc = serve(job, job_argv(card, job, requests, left - STARTUP_S / 2, SERVE_DIR), left)
        done.append({"job": job["name"], "rc": rc})
    return done


def gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    return subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout


def warnings(root: Path, limit: int = 40) -> list[str]:
    """Distinct warning/error lines of the served processes' logs (timestamps stripped), most frequent first."""
    pat = re.compile(r"warn|error|traceback|exception", re.I)
    stamp = re.compile(r"\d{2}:\d{2}:\d{2}[.,\d]*")
    seen: collections.Counter[str] = collections.Counter()
    for f in root.rglob("*.log"):
        try:
            for line in f.read_text(errors="replace").splitlines():
                if pat.search(line):
                    seen[stamp.sub("", line)[:300]] += 1
        except OSError:
            continue
    return [f"{n:6d} {line}" for line, n in seen.most_common(limit)]


def run(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    say(f"{' '.join(cmd)} (limit {timeout:.0f} s)")
    t0 = time.monotonic()
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    say(f"rc {rc} after {time.monotonic() - t0:.0f} s")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--engine", default="", help="arguments of gpu_engine.py (empty: skip it)")
    ap.add_argument("--serve", default="", help="arguments of gpu_serve.py, --out excepted (empty: skip it)")
    ap.add_argument("--engine-timeout", type=float, default=230)
    ap.add_argument("--serve-timeout", type=float, default=345)
    ap.add_argument("--plan", default="", help="a planned call (benchmarks/plans/*.json): jobs per card, one budget")
    ap.add_argument("--budget-s", type=float, default=550, help="--plan: the seconds all its jobs share")
    ap.add_argument("--gpu", default="", help="--plan: the card's name (default: nvidia-smi -L)")
    ap.add_argument("--no-devsite", action="store_true",
                    help="use this interpreter's packages (a dev machine: unpacking .devsite here would grow it "
                         "past the device's 64 MiB carry)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if (REPO / ".devsite").is_dir() and not args.no_devsite:
        subprocess.run(["bash", str(REPO / "benchmarks" / "devsite.sh")], check=True, cwd=REPO)
        site = [REPO / ".devsite" / "site", REPO / ".devsite"]
    else:
        site = []
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [*site, REPO / "runtime", REPO / "operator"])
    smi = shutil.which("nvidia-smi")
    if smi:
        subprocess.run([smi, "--query-gpu=name,memory.used,memory.total,driver_version", "--format=csv"], check=False)
    if args.engine.strip():
        cmd = [sys.executable, "benchmarks/gpu_engine.py", "--out", str(out), *shlex.split(args.engine)]
        run(cmd, out / "engine.log", args.engine_timeout, env)
        for line in (out / "engine.log").read_text(errors="replace").splitlines():
            if line.startswith("[") or "Error" in line:
                print(line[:700])
    if args.plan:
        plan = json.loads(Path(args.plan).read_text())
        name = args.gpu or gpu_name()
        (out / "nvidia_smi.txt").write_text(name)
        card = card_plan(plan, name)
        stop = threading.Event()

        def copy_jobs() -> None:
            for job in card["jobs"]:
                copy_serve(out, SERVE_DIR / job["name"], f"_{job['name']}", ("gpu_serve.json",))

        def plan_copier() -> None:
            while not stop.wait(5):
                copy_jobs()

        def serve(job: dict[str, Any], argv: list[str], left: float) -> int:
            log = out / "serve.log"
            with open(log, "ab") as f:
                f.write(f"== job {job['name']}\n".encode())
            cmd = [sys.executable, "benchmarks/gpu_serve.py", *argv]
            say(" ".join(cmd))
            with open(log, "ab") as f:
                try:
                    return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=left + 10,
                                          cwd=REPO).returncode
                except subprocess.TimeoutExpired:
                    return 124

        th = threading.Thread(target=plan_copier, daemon=True)
        th.start()
        try:
            result = run_plan(plan, name, args.budget_s, serve)
        finally:
            stop.set()
            th.join()
            copy_jobs()
        say(json.dumps(result))
        (out / "warn.txt").write_text("\n".join(warnings(SERVE_DIR)) + "\n")
    if args.serve.strip():
        stop = threading.Event()

        def copier() -> None:
            while not stop.wait(5):
                copy_serve(out)

        th = threading.Thread(target=copier, daemon=True)
        th.start()
        cmd = [sys.executable, "benchmarks/gpu_serve.py", "--out", str(SERVE_DIR), *shlex.split(args.serve)]
        try:
            run(cmd, out / "serve.log", args.serve_timeout, env)
        finally:
            stop.set()
            th.join()
            copy_serve(out)
        for line in (out / "serve.log").read_text(errors="replace").splitlines():
            if line.startswith("[gpu_serve"):
                print(line[:900])
        lines = warnings(SERVE_DIR)
        (out / "warn.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:25]))
    for f in sorted(out.iterdir()):
        say(f"{f.name}: {f.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
