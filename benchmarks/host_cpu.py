"""Where this host's CPU goes while a benchmark runs: CPU seconds by role, read from /proc.

Why: on the local cluster every pod, the control plane, Prometheus, the operator and the load
generator share two cores, and a trial's TTFT tail moves with what else runs beside it. These
helpers account the host's CPU by what each process is (a worker's ``--stage``, the partition
controller, the load Job's ``easerve bench``, Prometheus, the apiserver, ...), so a benchmark can
say which role was busy in which window. Accounting, not timing: nothing here is asserted.

- ``tree_cpu(pid)``: CPU seconds so far of a process and everything below it, by role
  (``trial_local.py``: ``easerve serve`` and its workers).
- ``HostSampler``: a thread sampling every process every ``interval`` s; ``by_trial()`` sums the
  CPU of each interval into the cluster trial whose load Job ran in it (``has_cluster.py``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
# (substring of the command line, role), first match wins; a worker's ``--stage`` comes first
ROLES = (
    ("partition_controller", "partition"),
    ("easerve_operator.cli bench", "load"),
    ("easerve bench", "load"),
    ("profile-stage", "profile"),
    ("easerve_operator.cli operator", "operator"),
    ("easerve_operator.cli up", "up"),
    ("easerve_operator.cli serve", "serve"),
    ("kubelet_harness", "kubelet-harness"),
    ("kube_proxy", "kube-proxy"),
    ("kube-apiserver", "apiserver"),
    ("kube-controller-manager", "k8s-control"),
    ("kube-scheduler", "k8s-control"),
    ("etcd", "etcd"),
    ("prometheus", "prometheus"),
)
TRIAL = re.compile(r"-t(\d+)[-.:/]")


def role(cmd: str) -> str:
    """What a process is, from its command line (``other`` when none of ``ROLES`` matches)."""
    args = cmd.split()
    if "--stage" in args[:-1]:
        return args[args.index("--stage") + 1]
    return next((r for key, r in ROLES if key in cmd), "other")


def processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds so far) of every user-space process."""
    out: dict[int, tuple[int, str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not cmd:  # a kernel thread
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        out[int(d.name)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every process below it, summed by ``role``."""
    procs = processes()
    mine, grew = {root}, True
    while grew:
        more = {pid for pid, (ppid, _, _) in procs.items() if ppid in mine} - mine
        mine |= more
        grew = bool(more)
    out: dict[str, float] = {}
    for pid in mine & set(procs):
        _, cmd, cpu = procs[pid]
        out[role(cmd)] = out.get(role(cmd), 0.0) + cpu
    return out


class HostSampler:
    """Every ``interval`` s: each process's CPU since the last sample, by role, tagged with the
    cluster trial whose load Job (``easerve bench --url ...-t<N>...``) was running then.

    A process that started within an interval counts all its CPU there; one that ended loses at
    most its last interval."""

    def __init__(self, interval: float = 2.0) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int | None, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)

    def __enter__(self) -> HostSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = processes()
        while not self._stop.wait(self.interval):
            now = processes()
            delta: dict[str, float] = {}
            trial = None
            for pid, (_, cmd, cpu) in now.items():
                prev = last.get(pid)
                used = cpu - prev[2] if prev is not None and prev[1] == cmd else cpu
                r = role(cmd)
                if used > 0:
                    delta[r] = delta.get(r, 0.0) + used
                if r == "load" and (m := TRIAL.search(cmd)) is not None:
                    trial = int(m.group(1))
            self.samples.append((time.time(), trial, delta))
            last = now

    def by_trial(self) -> dict[int, dict[str, float]]:
        """Per trial: CPU seconds by role over the intervals its load Job ran, ``wall_s``, and
        ``cores`` (all roles' CPU over that wall time: 2.0 is both cores busy)."""
        out: dict[int, dict[str, float]] = {}
        for _, trial, delta in self.samples:
            if trial is None:
                continue
            row = out.setdefault(trial, {"wall_s": 0.0})
            row["wall_s"] += self.interval
            for r, v in delta.items():
                row[r] = row.get(r, 0.0) + v
        for row in out.values():
            busy = sum(v for k, v in row.items() if k != "wall_s")
            row["cores"] = busy / row["wall_s"] if row["wall_s"] else 0.0
            for k in list(row):
                row[k] = round(row[k], 2)
        return out
