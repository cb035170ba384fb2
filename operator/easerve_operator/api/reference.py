"""The field reference of docs/api.md, generated from the same CRD schema (so it cannot drift)."""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import EPDDeploymentSpec

from easerve_operator.api.crd import _resolve, build_crd

BEGIN = "<!-- BEGIN GENERATED FIELD REFERENCE (easerve crd docs) -->"
END = "<!-- END GENERATED FIELD REFERENCE -->"


def _constraints(node: dict[str, Any]) -> str:
    out = []
    if "enum" in node:
        out.append(" \\| ".join(f"`{v}`" for v in node["enum"]))
    lo, hi = node.get("minimum"), node.get("maximum")
    if lo is not None or hi is not None:
        left = "(" if node.get("exclusiveMinimum") else "["
        right = ")" if node.get("exclusiveMaximum") else "]"
        out.append(f"{left}{'' if lo is None else lo}, {'' if hi is None else hi}{right}")
    if "pattern" in node:
        out.append(f"pattern `{node['pattern']}`")
    for key, label in (("minLength", "min length"), ("maxLength", "max length"), ("minItems", "min items"),
                       ("maxItems", "max items")):
        if key in node:
            out.append(f"{label} {node[key]}")
    return "; ".join(out)


def _defaults(node: Any, path: str, out: dict[str, Any]) -> None:
    """Defaults by wire path, from the pydantic schema (the CRD deliberately carries none)."""
    if not isinstance(node, dict):
        return
    if "default" in node and node["default"] is not None:
        out[path] = node["default"]
    for variant in node.get("anyOf", []):
        _defaults(variant, path, out)
    for name, child in (node.get("properties") or {}).items():
        _defaults(child, f"{path}.{name}", out)
    if isinstance(node.get("items"), dict):
        _defaults(node["items"], f"{path}[]", out)


def _rows(node: dict[str, Any], path: str, required: bool, out: list[str], defaults: dict[str, Any]) -> None:
    typ = node.get("type", "any")
    if typ == "array":
        typ = f"array of {node.get('items', {}).get('type', 'any')}"
    desc = (node.get("description") or "").replace("\n", " ").replace("|", "\\|")
    req = "yes" if required else ""
    dflt = defaults.get(path)
    shown = f"`{dflt}`" if dflt is not None and not isinstance(dflt, (dict, list)) else ""
    out.append(f"| `{path}` | {typ} | {req} | {shown} | {_constraints(node)} | {desc} |")
    props = node.get("properties") or {}
    if node.get("type") == "array":
        props = (node.get("items") or {}).get("properties") or {}
        sub_required = set((node.get("items") or {}).get("required") or [])
        prefix = f"{path}[]"
    else:
        sub_required = set(node.get("required") or [])
        prefix = path
    for name, child in props.items():
        _rows(child, f"{prefix}.{name}", name in sub_required, out, defaults)


def field_reference() -> str:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    raw = EPDDeploymentSpec.model_json_schema(by_alias=True, mode="validation")
    defaults: dict[str, Any] = {}
    _defaults(_resolve(raw, raw.get("$defs", {})), "spec", defaults)
    head = "| field | type | required | default | allowed | meaning |"
    lines = [BEGIN, "", head, "|---|---|---|---|---|---|"]
    _rows(schema["spec"], "spec", True, lines, defaults)
    lines += ["", head.replace("field", "status field"), "|---|---|---|---|---|---|"]
    _rows(schema["status"], "status", False, lines, {})
    lines += ["", END]
    return "\n".join(lines) + "\n"
