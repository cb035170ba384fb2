#!/bin/bash
# One-time (and idempotent) set-up of a fresh Debian bookworm machine, as root, for EAServe:
# Debian packages, a Python venv with the project and its dev tools, the Kubernetes control plane
# built from Debian's source package, and helm/kubectl. Everything built is cached outside the
# clone in $EASERVE_CACHE (default ~/.cache/easerve) and rebuilt only when missing.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
VENV=$CACHE/venv
say() { printf '[bootstrap] %s\n' "$*" >&2; }

say "Debian packages (etcd, prometheus, Go toolchain, kubernetes source deps)"
bash "$HERE/setup-host.sh"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp=$VENV/.easerve-installed
want=$(sha256sum "$REPO/pyproject.toml" | cut -c1-16):$REPO
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing easerve and its dev tools into $VENV"
  "$VENV/bin/pip" install -q -e "$REPO[dev]"
  echo "$want" > "$stamp"
fi

# The torch engine (engine.backend: torch) and its CPU tests need torch + transformers. PyPI's
# x86_64 torch wheel is a CUDA build that pulls ~2.5 GB of nvidia-* wheels; torch==2.13.0 is the
# release this machine kind keeps on disk as a 192 MB CPU build (/opt/wheels, found by pip's
# find-links), so pinning it costs no download here and still resolves from PyPI elsewhere
# (there as the CUDA build). EASERVE_TORCH overrides the pin (e.g. 'torch>=2.11' on a GPU box
# that already has one). Cached in the venv by a stamp, like the project install above.
TORCH_REQ=${EASERVE_TORCH:-torch==2.13.0}
TF_REQ='transformers>=5.17,<5.18'
# Triton: the decode attention and sampling kernels (engines/decode_attention.py, gumbel_argmax.py).
# CUDA builds of torch bring their own (already satisfied); on a CPU the tests run the same kernels
# under Triton's interpreter.
TRITON_REQ='triton>=3.2'
tstamp=$VENV/.easerve-torch
twant="$TORCH_REQ $TF_REQ $TRITON_REQ"
if [ "$(cat "$tstamp" 2>/dev/null)" != "$twant" ]; then
  say "installing $TORCH_REQ, $TF_REQ and $TRITON_REQ into $VENV (torch engine)"
  "$VENV/bin/pip" install -q "$TORCH_REQ" "$TF_REQ" "$TRITON_REQ"
  echo "$twant" > "$tstamp"
fi

say "Kubernetes control plane binaries (built once from Debian's source package, ~4 min on 2 cores)"
bash "$HERE/build-k8s.sh"
say "helm and kubectl"
bash "$HERE/get-helm.sh" >/dev/null
say "ready: $VENV/bin/easerve"
