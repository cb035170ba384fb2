#!/bin/bash
# Install the Debian packages the project needs on a fresh bookworm machine (root):
# etcd, prometheus, the Go toolchain and the kubernetes *source* package (for building the
# control plane offline), openssl/curl, and python3-venv. Idempotent: skips when all present.
set -euo pipefail
need=(dpkg-dev golang-go make rsync time golang-github-modern-go-reflect2-dev etcd-server prometheus
      openssl curl bc python3-venv lua5.1)
missing=()
for p in "${need[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# deb-src is needed for `apt-get source kubernetes`
if ! grep -rqs 'deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  cat > /etc/apt/sources.list.d/easerve-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  missing+=(__update__)
fi
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  pkgs=()
  for p in "${missing[@]}"; do [ "$p" = __update__ ] || pkgs+=("$p"); done
  if [ ${#pkgs[@]} -gt 0 ]; then
    # prometheus/etcd must not auto-start as system services: we run our own on loopback
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    rm -f /usr/sbin/policy-rc.d
  fi
fi
