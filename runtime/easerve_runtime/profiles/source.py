"""Where a deployment's latency profile comes from, and the one function that loads it.

A spec names its profile in exactly one of three ways (``api.rules`` enforces "exactly one"):

- ``spec.engine.profile``: a shipped ``<model>@<gpu>`` (package data);
- ``spec.engine.profileFile``: a path to a profile file (``profiles.schema``);
- ``spec.engine.profileConfigMap``: a ConfigMap whose ``profile.json`` the renderer mounts at
  ``api.PROFILE_DIR`` in every pod (``EASERVE_PROFILE_DIR`` overrides the directory elsewhere).

``spec_profile(spec)`` is what the sim engine, the twin, HAS's runners, the partition controller
and the CLI call: it resolves the source, loads and validates the file, and refuses a spec whose
``spec.model.encoder`` is not the profile's encoder (the costs would be another encoder's). The
omni-colocated mode's profiles are a different model (``omni.profile``); ``profile_path(spec)``
gives their file the same way.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from easerve_runtime.api import PROFILE_DIR, PROFILE_DIR_ENV, PROFILE_KEY, SpecError
from easerve_runtime.profiles.calibration import calibration, encoder_calib
from easerve_runtime.profiles.hardware import backbone, gpu, load_json
from easerve_runtime.profiles.measured import corrections
from easerve_runtime.profiles.profile import Profile
from easerve_runtime.profiles.schema import ModelsDoc, ProfileFileDoc, validation_lines

if TYPE_CHECKING:
    from easerve_runtime.api import EPDDeploymentSpec


class ProfileFileError(ValueError):
    """A profile file that cannot be read or does not follow the schema; says which file and field."""


@dataclass(frozen=True)
class ProfileSource:
    """One of the three ways a spec names its profile. ``field`` is the wire path to blame."""

    kind: Literal["name", "file", "configmap"]
    field: str
    value: str  # the shipped name, the path, or the ConfigMap name

    def path(self) -> Path | None:
        """The file to read (None for a shipped name)."""
        if self.kind == "file":
            return Path(self.value)
        if self.kind == "configmap":
            return Path(os.environ.get(PROFILE_DIR_ENV) or PROFILE_DIR) / PROFILE_KEY
        return None


def profile_source(spec: EPDDeploymentSpec) -> ProfileSource:
    e = spec.engine
    if e.profile_file is not None:
        return ProfileSource("file", "spec.engine.profileFile", e.profile_file)
    if e.profile_config_map is not None:
        return ProfileSource("configmap", "spec.engine.profileConfigMap", e.profile_config_map)
    if e.profile is None:  # the spec's rules forbid this; a hand-built EngineSpec may not
        raise SpecError("spec.engine", "no latency profile: set spec.engine.profile, profileFile or profileConfigMap")
    return ProfileSource("name", "spec.engine.profile", e.profile)


def profile_path(spec: EPDDeploymentSpec) -> str:
    """What the omni loader takes: the shipped name, or the path of the file to read."""
    src = profile_source(spec)
    p = src.path()
    return src.value if p is None else str(p)


# ------------------------------------------------------------------------------ building
def _shipped_models() -> dict[str, Any]:
    return ModelsDoc.model_validate(load_json("models.json")).model_dump()


def build_profile(
    name: str,
    models: dict[str, Any],
    gpus: dict[str, Any],
    links: dict[str, Any],
    encoder_tables: dict[str, Any] | None = None,
    where: str = "profile",
) -> Profile:
    """The profile ``<model>@<gpu>`` of the given data (shipped, or shipped merged with a file's).

    ``encoder_tables`` are H200 curves of encoders beyond the shipped calibration. Errors name
    ``where`` (the file) and the missing cross-reference.
    """
    model, sep, gpu_name = name.partition("@")
    known = [f"{m}@{g}" for m in sorted(models["models"]) for g in sorted(gpus)]
    if not sep or model not in models["models"] or gpu_name not in gpus:
        raise ProfileFileError(f"{where}: unknown profile {name!r}; known profiles: {', '.join(known)}")
    m = models["models"][model]
    enc_name = m["encoder"]
    if enc_name not in models["encoders"]:
        raise ProfileFileError(
            f"{where}: models.models.{model}.encoder: {enc_name!r} is not in models.encoders "
            f"(known: {', '.join(sorted(models['encoders']))})"
        )
    if m["backbone"] not in models["backbones"]:
        raise ProfileFileError(
            f"{where}: models.models.{model}.backbone: {m['backbone']!r} is not in models.backbones "
            f"(known: {', '.join(sorted(models['backbones']))})"
        )
    if gpus[gpu_name]["link"] not in links:
        raise ProfileFileError(
            f"{where}: gpus.{gpu_name}.link: {gpus[gpu_name]['link']!r} is not in links (known: {', '.join(sorted(links))})"
        )
    calib = calibration()
    if encoder_tables:
        calib = replace(calib, encoders={**calib.encoders, **{k: encoder_calib(v) for k, v in encoder_tables.items()}})
    if enc_name not in calib.encoders:
        raise ProfileFileError(
            f"{where}: h200_anchors.encoders.{enc_name}: the encoder has no measured H200 curve "
            "(graph_ms or eager_ms per batch size); a new encoder needs one"
        )
    enc = models["encoders"][enc_name]
    return Profile(
        name=name,
        model=model,
        gpu=gpu_name,
        encoder=enc_name,
        modality=m["modality"],
        hf_name=m["hf"],
        backbone=backbone(m["backbone"], models["backbones"]),
        hw=gpu(gpu_name, gpus, links),
        tokens_per_encoder_item=int(enc["tokens_per_item"]),
        encoder_item=enc["item"],
        encoder_mode=enc["mode"],
        anyres=bool(m.get("anyres", False)),
        calib=calib,
        _enc=calib.encoders[enc_name],
    )


def _section(shipped: dict[str, Any], doc: Any) -> dict[str, Any]:
    return {**{k: v for k, v in shipped.items() if not k.startswith("_")}, **doc}


def parse_profile_file(data: Any, where: str = "profile file") -> Profile:
    """A profile from a profile file's JSON value: validated, merged over the shipped data."""
    try:
        doc = ProfileFileDoc.model_validate(data)
    except ValidationError as exc:
        raise ProfileFileError(f"{where}: " + "; ".join(validation_lines(exc))) from None
    shipped = _shipped_models()
    own = doc.models.model_dump()
    models = {k: {**shipped[k], **own[k]} for k in ("backbones", "encoders", "models")}
    gpus = _section(load_json("gpus.json"), {k: v.model_dump() for k, v in doc.gpus.items()})
    links = _section(load_json("links.json"), {k: v.model_dump() for k, v in doc.links.items()})
    tables = {k: v.model_dump(exclude_none=True) for k, v in doc.h200_anchors.encoders.items()}
    prof = build_profile(doc.profile, models, gpus, links, tables, where)
    if doc.engine is not None:
        prof = replace(prof, corrections=corrections(prof, doc.engine.model_dump()))
    return prof


_FILES: dict[tuple[str, int, int], Profile] = {}
_LOCK = threading.Lock()


def load_profile_file(path: str | Path, field: str = "profile file") -> Profile:
    """Read, validate and build a profile file; cached per (path, mtime, size) so the twin's
    hundreds of trials read it once. Errors start with ``field`` and the path."""
    p = Path(path)
    where = f"{field}: {p}"
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    except OSError as exc:
        raise ProfileFileError(f"{where}: cannot read ({exc.strerror or exc})") from None
    with _LOCK:
        hit = _FILES.get(key)
    if hit is not None:
        return hit
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ProfileFileError(f"{where}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{where}: not JSON ({exc})") from None
    prof = parse_profile_file(data, where)
    with _LOCK:
        _FILES[key] = prof
    return prof


# ------------------------------------------------------------------------------ the one way in
def spec_profile(spec: EPDDeploymentSpec) -> Profile:
    """The latency profile of a deployment, from whichever source its spec names.

    Raises ``SpecError`` naming the field: an unknown shipped name, an unreadable or invalid file
    (``spec.engine.profileFile`` / ``profileConfigMap``), or an encoder mismatch
    (``spec.model.encoder``, naming both encoders).
    """
    from easerve_runtime.profiles import load_profile

    src = profile_source(spec)
    try:
        if src.kind == "name":
            prof = load_profile(src.value)
        else:
            path = src.path()
            assert path is not None
            if src.kind == "configmap" and not path.exists():
                raise SpecError(
                    src.field,
                    f"ConfigMap {src.value!r} is read from {path} (its key {PROFILE_KEY}, mounted by the "
                    f"operator in every pod); it is not there. Outside a pod set {PROFILE_DIR_ENV} to a "
                    "directory holding profile.json, or use spec.engine.profileFile",
                )
            prof = load_profile_file(path, field=src.field)
    except SpecError:
        raise
    except ValueError as exc:
        msg = str(exc)
        prefix = f"{src.field}: "
        raise SpecError(src.field, msg[len(prefix) :] if msg.startswith(prefix) else msg) from None
    check_encoder(spec, prof)
    return prof


def check_encoder(spec: EPDDeploymentSpec, prof: Profile) -> None:
    if spec.model.encoder != prof.encoder:
        raise SpecError(
            "spec.model.encoder",
            f"is {spec.model.encoder!r} but the latency profile {prof.name!r} "
            f"({profile_source(spec).field}) describes encoder {prof.encoder!r}: the costs would be another "
            "encoder's. Use a profile for your encoder (a profile file can add one, docs/profiles.md) or fix "
            "spec.model.encoder",
        )


def profile_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    """The spec-against-profile checks that can run HERE, as a list (empty when they pass), for
    callers that validate a spec for somewhere else (``easerve render``, the reconciler).

    A shipped name is always checked. A file or ConfigMap is checked only when it is readable at
    its path here: the operator does not see the pods' files, and the workers run the full
    ``spec_profile`` when they start. An omni-colocated spec's profile is an ``omni.profile``
    model, checked by its own loader."""
    if str(spec.mode) == "omni-colocated":
        return []
    src = profile_source(spec)
    path = src.path()
    if path is not None and not path.exists():
        return []
    try:
        spec_profile(spec)
    except SpecError as exc:
        return [exc]
    return []
