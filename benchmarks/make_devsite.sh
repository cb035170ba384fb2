#!/bin/bash
# On the dev machine: build .devsite/ (git-ignored), what the GPU machine needs to run
# `easerve serve` and has no registry to fetch: Dynamo's runtime (its 226 MB core library
# stripped of its static symbols, 174 MB, and xz-compressed to 38 MB, so the folder and the
# tracked tree travel within a 64 MiB carry) and the wheels of the
# runtime's pure dependencies for CPython 3.12. benchmarks/devsite.sh unpacks it there.
# What travels to the GPU machine: .devsite/dynamo (37 MB) and .devsite/site.tar.xz (3.1 MB, the
# wheels unpacked; below), with the tracked tree (21.7 MB on 2026-12-07), in one 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$tmp" ai-dynamo-runtime==1.6.1
(cd "$tmp" && unzip -q ai_dynamo_runtime-*.whl 'dynamo/*')
mkdir -p .devsite && rm -rf .devsite/dynamo && mv "$tmp/dynamo" .devsite/dynamo
strip --strip-unneeded .devsite/dynamo/_core.abi3.so   # the dynamic symbols Python loads stay
xz -9 -T0 .devsite/dynamo/_core.abi3.so   # -> _core.abi3.so.xz
$PY -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$tmp/wheels" uvloop aiohttp prometheus_client pyyaml tqdm "pydantic>=2.10.6,<=2.13.5"
# Downloaded afresh and swapped in whole: a wheel left by an earlier download (another version of
# the same package) would otherwise be unpacked into the same tree below.
rm -rf .devsite/wheels && mv "$tmp/wheels" .devsite/wheels
# The same wheels unpacked (a wheel is its site-packages layout) into one xz archive, 7.4 MB
# against 10 MB of wheels, less those the GPU machine's torch stack already has (pyyaml, tqdm,
# idna). Why: by 2026-12 the tracked tree (18.7 MB), dynamo/ and the wheels no longer fit one
# 64 MiB carry; the tree, dynamo/ and this archive do, in one call:
#   carry [".devsite/site.tar.xz", ".devsite/dynamo"]; benchmarks/devsite.sh unpacks it.
site="$tmp/site"; mkdir -p "$site"
for w in .devsite/wheels/*.whl; do
    case "$(basename "$w")" in pyyaml-*|tqdm-*|idna-*) continue ;; esac
    $PY -m zipfile -e "$w" "$site"
done
# Their extension modules stripped of debug symbols, as _core above: 7.4 -> 3.1 MB xz (uvloop's
# loop.so alone is 16 MB unstripped), so the carry stays under 64 MiB as the tracked tree grows.
find "$site" -name '*.so' -exec strip --strip-unneeded {} +
tar cJf .devsite/site.tar.xz -C "$site" .
du -sh .devsite
