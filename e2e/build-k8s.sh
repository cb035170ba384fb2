#!/bin/bash
# Build the Kubernetes v1.20.2 control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler) offline from Debian bookworm's `kubernetes` SOURCE package with Debian's Go.
# Output is cached outside the clone, in $EASERVE_CACHE/k8s/bin (default ~/.cache/easerve);
# a second call finds the binaries and returns at once.
set -euo pipefail
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
DEST=$CACHE/k8s
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)
done_all=1
for c in "${COMPONENTS[@]}"; do [ -x "$DEST/bin/$c" ] || done_all=0; done
[ $done_all = 1 ] && exit 0

mkdir -p "$DEST/src" "$DEST/bin" "$DEST/gopath/src/k8s.io"
SRC=$(ls -d "$DEST"/src/kubernetes-*/ 2>/dev/null | head -1 || true)
if [ -z "$SRC" ]; then
  (cd "$DEST/src" && apt-get source -qq kubernetes >/dev/null 2>&1)
  SRC=$(ls -d "$DEST"/src/kubernetes-*/ | head -1)
fi
SRC=${SRC%/}
# The vendored reflect2 v1.0.1 segfaults under Go >= 1.18; Debian ships v1.0.2.
if ! [ -f "$SRC/vendor/github.com/modern-go/reflect2/go_above_118.go" ]; then
  rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$SRC/vendor/github.com/modern-go/reflect2"
fi
# The generated OpenAPI definitions are not shipped in the source package.
if ! [ -f "$SRC/pkg/generated/openapi/zz_generated.openapi.go" ]; then
  (cd "$SRC" && make gen_openapi >/dev/null 2>&1)
fi
ln -sfn "$SRC" "$DEST/gopath/src/k8s.io/kubernetes"
export GOPATH="$DEST/gopath" GOCACHE="$DEST/gocache" GO111MODULE=off GOFLAGS= GOPROXY=off CGO_ENABLED=0
cd "$GOPATH/src/k8s.io/kubernetes"
V=v1.20.2
LD="-s -w"
for p in k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version k8s.io/kubernetes/vendor/k8s.io/component-base/version; do
  LD="$LD -X $p.gitVersion=$V -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
done
for c in "${COMPONENTS[@]}"; do
  [ -x "$DEST/bin/$c" ] && continue
  echo "building $c (first time only; cached in $DEST/bin)" >&2
  go build -ldflags "$LD" -o "$DEST/bin/$c.tmp" "./cmd/$c"
  mv "$DEST/bin/$c.tmp" "$DEST/bin/$c"
done
