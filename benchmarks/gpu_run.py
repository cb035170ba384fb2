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
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVE_DIR = Path("/tmp/gs")


def say(msg: str) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy_serve(out: Path) -> None:
    for name in ("gpu_serve.json", "gpu_serve.png"):
        f = SERVE_DIR / name
        if f.exists():
            with contextlib.suppress(OSError):
                shutil.copyfile(f, out / name)


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
