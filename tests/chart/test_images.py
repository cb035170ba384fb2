"""Dockerfile consistency, checked without a Docker engine (CI has none).

Each Dockerfile under images/ is parsed; every COPY source must exist in the repository (the build
context is the repository root), every ENTRYPOINT/CMD/HEALTHCHECK command must be something the
image provides (a package it installs, a file it copies, the `easerve` console script), every
`easerve` subcommand must exist, and base images must be pinned by version or digest.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = sorted((REPO / "images").glob("*/Dockerfile"))


@dataclass
class Instruction:
    op: str
    args: str
    line: int


def parse(path: Path) -> list[Instruction]:
    """Dockerfile instructions with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append(Instruction(op.upper(), args.strip(), start))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec) form or a shell form, as argv."""
    if args.startswith("["):
        return list(json.loads(args))
    return shlex.split(args)


def args_of(path: Path) -> dict[str, str]:
    return {
        m.group(1): m.group(2)
        for i in parse(path)
        if i.op == "ARG"
        for m in [re.match(r"(\w+)=(.*)", i.args)]
        if m
    }


def expand(text: str, argv: dict[str, str]) -> str:
    for _ in range(3):
        text = re.sub(r"\$\{(\w+)\}", lambda m: argv.get(m.group(1), m.group(0)), text)
    return text


def easerve_commands() -> set[str]:
    from easerve_operator.cli import COMMANDS

    return set(COMMANDS)


def console_scripts() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def test_there_are_the_three_images() -> None:
    assert {p.parent.name for p in IMAGES} == {"operator", "runtime-cpu", "runtime-gpu"}


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_copy_sources_exist_in_the_repository(dockerfile: Path) -> None:
    for ins in parse(dockerfile):
        if ins.op not in ("COPY", "ADD"):
            continue
        parts = [p for p in exec_form(ins.args) if not p.startswith("--")]
        if any(f.startswith("--from") for f in exec_form(ins.args)):
            continue  # from an earlier build stage
        *sources, _dest = parts
        assert sources, f"{dockerfile}:{ins.line}: COPY without a source"
        for src in sources:
            matches = list(REPO.glob(src.rstrip("/"))) if any(c in src for c in "*?[") else [REPO / src]
            assert matches and all(m.exists() for m in matches), (
                f"{dockerfile}:{ins.line}: {src} not in the repo"
            )


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_copy_sources_are_in_the_build_context(dockerfile: Path) -> None:
    """The Dockerfile's own .dockerignore (BuildKit) excludes everything but what it copies."""
    ignore = dockerfile.with_name("Dockerfile.dockerignore")
    assert ignore.exists(), f"{ignore} is missing: the whole repository would be sent as build context"
    lines = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "start from nothing, then let in what the image copies"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for ins in parse(dockerfile):
        if ins.op == "COPY" and "--from" not in ins.args:
            for src in [p for p in exec_form(ins.args) if not p.startswith("--")][:-1]:
                src = src.rstrip("/")
                assert any(src == a or src.startswith(a + "/") for a in allowed), (
                    f"{dockerfile}:{ins.line}: {src} is excluded by {ignore.name}"
                )


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    argv = args_of(dockerfile)
    stages = set()
    for ins in parse(dockerfile):
        if ins.op != "FROM":
            continue
        words = ins.args.split()
        image = expand(words[0], argv)
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2])
        if image in stages:
            continue
        assert "@sha256:" in image or re.search(r":[0-9]+\.[0-9]+(\.[0-9]+)?", image), (
            f"{dockerfile}:{ins.line}: base image {image} is not pinned by version or digest"
        )
        assert not image.endswith(":latest")


def _provided(dockerfile: Path) -> set[str]:
    """Executables the image provides: apt packages it installs, files it copies, console scripts."""
    provided = set(console_scripts()) | {"python3", "python", "pip"}
    for ins in parse(dockerfile):
        if ins.op == "RUN" and "apt-get install" in ins.args:
            for pkg in re.findall(
                r"\s([a-z0-9][a-z0-9.+-]+)(?=\s|$)", ins.args.split("apt-get install", 1)[1]
            ):
                provided |= {pkg, f"/usr/bin/{pkg}"}
        if ins.op == "COPY" and "--from" not in ins.args:
            provided.add(exec_form(ins.args)[-1])
    return provided


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_entrypoint_commands_exist(dockerfile: Path) -> None:
    provided = _provided(dockerfile)
    commands = easerve_commands()
    seen = {"ENTRYPOINT": False, "CMD": False, "HEALTHCHECK": False}
    argv: list[str] = []
    for ins in parse(dockerfile):
        if ins.op in ("ENTRYPOINT", "CMD"):
            seen[ins.op] = True
            assert ins.args.startswith("["), (
                f"{dockerfile}:{ins.line}: use the exec form so signals reach tini"
            )
            argv += exec_form(ins.args)
        if ins.op == "HEALTHCHECK":
            seen["HEALTHCHECK"] = True
            check = exec_form(ins.args.split("CMD", 1)[1].strip())
            assert check[0] in provided, f"{dockerfile}:{ins.line}: {check[0]} is not in the image"
            for word in check[1:]:
                if word.startswith("/usr/local/bin/"):
                    assert word in provided, f"{dockerfile}:{ins.line}: {word} is not copied into the image"
    assert all(seen.values()), f"{dockerfile}: missing {[k for k, v in seen.items() if not v]}"
    assert argv[:2] == ["/usr/bin/tini", "--"], f"{dockerfile}: the entrypoint must be tini"
    assert argv[2] in provided, f"{dockerfile}: {argv[2]} is not provided by the image"
    if argv[2] == "easerve":
        assert argv[3] in commands, f"{dockerfile}: `easerve {argv[3]}` is not a registered subcommand"


@pytest.mark.parametrize("dockerfile", IMAGES, ids=lambda p: p.parent.name)
def test_images_run_as_non_root(dockerfile: Path) -> None:
    users = [i.args for i in parse(dockerfile) if i.op == "USER"]
    assert users, f"{dockerfile}: no USER"
    assert users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile}: the final USER is root"


def test_gpu_image_matches_the_dynamo_runtime_pin() -> None:
    argv = args_of(REPO / "images" / "runtime-gpu" / "Dockerfile")
    image = expand(argv["DYNAMO_IMAGE"], argv)
    assert image.startswith("nvcr.io/nvidia/ai-dynamo/vllm-runtime:")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("ai-dynamo-runtime")]
    lower = re.search(r">=\s*([0-9]+\.[0-9]+)", pin)
    assert lower, pin
    assert argv["DYNAMO_VERSION"].startswith(lower.group(1) + "."), (
        f"images/runtime-gpu pins Dynamo {argv['DYNAMO_VERSION']} but pyproject wants {pin}"
    )


def test_runtime_image_default_matches_the_spec_default() -> None:
    """The spec's default engine image is the CPU runtime image this repo builds."""
    from easerve_runtime.api import EngineSpec

    default = EngineSpec.model_fields["image"].default
    assert default.split("/")[-1].split(":")[0] == "runtime-cpu"
