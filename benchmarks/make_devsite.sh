#!/bin/bash
# On the dev machine: build .devsite/ (git-ignored), what the GPU machine needs to run
# `easerve serve` and has no registry to fetch: Dynamo's runtime (its 226 MB core library
# stripped of its static symbols, 174 MB, and xz-compressed to 38 MB, so the folder and the
# tracked tree travel within a 64 MiB carry) and the wheels of the
# runtime's pure dependencies for CPython 3.12. benchmarks/devsite.sh unpacks it there.
# The two parts (dynamo/ 37 MB, wheels/ 11 MB) and the tracked tree (~16 MB, 2026-12) now pass
# the device's 64 MiB carry together, so carry them in two calls on one warm machine: first
# .devsite/wheels with `pip install --no-index --find-links .devsite/wheels --target .devsite/site ...`
# (an ignored output the machine keeps between calls), then .devsite/dynamo for the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p .devsite/wheels
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$tmp" ai-dynamo-runtime==1.6.1
(cd "$tmp" && unzip -q ai_dynamo_runtime-*.whl 'dynamo/*')
rm -rf .devsite/dynamo && mv "$tmp/dynamo" .devsite/dynamo
strip --strip-unneeded .devsite/dynamo/_core.abi3.so   # the dynamic symbols Python loads stay
xz -9 -T0 .devsite/dynamo/_core.abi3.so   # -> _core.abi3.so.xz
$PY -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .devsite/wheels uvloop aiohttp prometheus_client pyyaml tqdm "pydantic>=2.10.6,<=2.13.5"
du -sh .devsite
