"""JSONL traces: one request per line, the exchange format between the twin and the live client.

Unknown keys are rejected and every line is validated, naming the line and field, so a trace
that does not mean what its author thought fails loudly instead of being silently reinterpreted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from easerve_runtime.workload.request import Request

_FIELDS = {f.name for f in fields(Request)}
_REQUIRED = {"id", "arrival_s", "modality"}
_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "arrival_s": (int, float),
    "modality": (str,),
    "media": (dict,),
    "encoder_items": (int,),
    "prompt_tokens": (int,),
    "media_tokens": (int,),
    "output_tokens": (int,),
    "priority": (int,),
}


def request_to_json(r: Request) -> str:
    d = asdict(r)
    if d.get("output_class") is None:
        d.pop("output_class", None)
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def write_trace(path: str | Path, reqs: list[Request]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for r in reqs:
            f.write(request_to_json(r) + "\n")


def parse_request(d: object, where: str = "request") -> Request:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    unknown = set(d) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = _REQUIRED - set(d)
    if missing:
        raise ValueError(f"{where}: missing field(s) {sorted(missing)}")
    for key, kinds in _TYPES.items():
        if key in d and (not isinstance(d[key], kinds) or isinstance(d[key], bool)):
            raise ValueError(
                f"{where}: {key}: expected {' or '.join(k.__name__ for k in kinds)}, got {d[key]!r}"
            )
    try:
        r = Request(**d)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    try:
        r.validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return r


def read_trace(path: str | Path) -> list[Request]:
    """Requests in file order; ids must be unique and arrivals non-decreasing."""
    out: list[Request] = []
    seen: set[str] = set()
    last = -1.0
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON: {exc.msg}") from exc
        r = parse_request(d, where)
        if r.id in seen:
            raise ValueError(f"{where}: id: duplicate request id {r.id!r}")
        if r.arrival_s < last:
            raise ValueError(f"{where}: arrival_s: {r.arrival_s} is before the previous line's {last}")
        seen.add(r.id)
        last = r.arrival_s
        out.append(r)
    return out
