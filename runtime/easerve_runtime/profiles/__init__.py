"""Latency profiles: what each stage costs for a model on a GPU, derived from H200 measurements.

``load_profile("llava-v1.6-34b@rtx6000ada")`` returns a shipped ``Profile``; ``list_profiles()``
lists their names; ``load_profile_file(path)`` reads a user's profile file (``schema.py``: the
shipped files' schema, docs/profiles.md). Every consumer that has a spec calls
``spec_profile(spec)``, which picks the source the spec names (``spec.engine.profile``,
``profileFile`` or ``profileConfigMap``) and checks ``spec.model.encoder`` against it.

Data lives in ``profiles/data/`` (GPU datasheets, link assumptions, model shapes and the H200
measurements); ``calibration.py`` fits the efficiencies once; ``profile.py`` scales them.
Read docs/profiles.md for every assumption.
"""

from __future__ import annotations

from functools import cache

from easerve_runtime.profiles.calibration import calibration
from easerve_runtime.profiles.hardware import GPU, Backbone, backbone, gpu, gpu_names, load_json
from easerve_runtime.profiles.profile import TP_CHOICES, Profile
from easerve_runtime.profiles.source import (
    ProfileFileError,
    ProfileSource,
    build_profile,
    load_profile_file,
    parse_profile_file,
    profile_errors,
    profile_path,
    profile_source,
    spec_profile,
)

__all__ = [
    "GPU",
    "TP_CHOICES",
    "Backbone",
    "Profile",
    "ProfileFileError",
    "ProfileSource",
    "backbone",
    "calibration",
    "gpu",
    "list_profiles",
    "load_profile",
    "load_profile_file",
    "parse_profile_file",
    "profile_errors",
    "profile_path",
    "profile_source",
    "spec_profile",
]


def list_profiles() -> list[str]:
    models = load_json("models.json")["models"]
    return [f"{m}@{g}" for m in sorted(models) for g in gpu_names()]


@cache
def load_profile(name: str) -> Profile:
    """The shipped profile ``<model>@<gpu>``; an unknown name is a ValueError that lists the known ones."""
    model, sep, gpu_name = str(name).partition("@")
    data = load_json("models.json")
    if not sep or model not in data["models"] or gpu_name not in gpu_names():
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(list_profiles())}")
    gpus = {k: v for k, v in load_json("gpus.json").items() if not k.startswith("_")}
    links = {k: v for k, v in load_json("links.json").items() if not k.startswith("_")}
    return build_profile(f"{model}@{gpu_name}", data, gpus, links, where="spec.engine.profile")
