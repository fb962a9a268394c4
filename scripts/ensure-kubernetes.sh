#!/usr/bin/env bash
# Make sure the Kubernetes binaries that e2e/localkube runs exist: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy and crictl, built from Kubernetes' own
# Go modules as pinned by e2e/localkube/gomod (go.mod and go.sum; crictl from gomod/crictl), and the
# cluster's add-ons: CoreDNS (cluster DNS; gomod/coredns, a main package with the plugins it needs)
# and local-path-provisioner (the default StorageClass's provisioner, as in kind; gomod/local-path-provisioner).
#
# They go to a cache outside the work tree, one folder per set of pins:
#   ${PGHERD_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/kubernetes}/<hash>/bin
# where <hash> covers both modules' go.mod and go.sum, the Go version and this script's build recipe.
# A stamp file marks a finished build; while the pins are unchanged, running again is a no-op. The Go
# build cache and module cache live in the same cache root (PGHERD_GOCACHE and PGHERD_GOMODCACHE
# override them). Modules come from the Go module proxy (GOPROXY as configured), nothing else is
# fetched. Builds run under `nice -n 19`: the machine is shared.
#
# Usage: scripts/ensure-kubernetes.sh [--rebuild | --check]
#   --check   build nothing: print the bin folder and exit 0 when it is built, exit 1 otherwise
# Messages go to stderr; the last line on stdout is the bin folder, so that
#   bin=$(scripts/ensure-kubernetes.sh)
# works from other scripts.
set -euo pipefail
cd "$(dirname "$0")/.."

# Bump when the way the binaries are built changes (flags, tags, list of commands): it is part of the
# hash, so an old cache is not reused for a new recipe.
RECIPE=2
MOD=e2e/localkube/gomod
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy crictl coredns local-path-provisioner)
# Modules of their own beside the main one (each with go.mod and go.sum).
ADDONS=(crictl coredns local-path-provisioner)

rebuild=0
check=0
case "${1:-}" in
  "") ;;
  --rebuild) rebuild=1 ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--rebuild | --check]" >&2; exit 2 ;;
esac

say() { echo "ensure-kubernetes: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  say "the go command is missing; install Go (1.26 or newer) first"
  exit 1
fi

goversion=$(GOTOOLCHAIN=local go env GOVERSION)
hash=$(
  {
    echo "recipe $RECIPE $goversion"
    cat "$MOD/go.mod" "$MOD/go.sum"
    for addon in "${ADDONS[@]}"; do cat "$MOD/$addon/go.mod" "$MOD/$addon/go.sum"; done
    cat "$MOD/coredns/main.go"
  } | sha256sum | cut -c1-16
)
root=${PGHERD_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/kubernetes}
dir=$root/$hash
bin=$dir/bin
stamp=$dir/stamp

complete() {
  [ -f "$stamp" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$bin/$b" ] || return 1; done
}

if [ "$check" = 1 ]; then
  if complete; then echo "$bin"; exit 0; fi
  say "not built: $bin"
  exit 1
fi

mkdir -p "$root"
# One build at a time per cache root: a second caller waits, then finds the stamp.
exec 9>"$root/.lock"
if ! flock -n 9; then
  say "another build holds $root/.lock; waiting for it"
  flock 9
fi

if [ "$rebuild" = 0 ] && complete; then
  say "present: $bin ($(head -n1 "$stamp"))"
  echo "$bin"
  exit 0
fi

export GOCACHE=${PGHERD_GOCACHE:-$root/go-build}
export GOMODCACHE=${PGHERD_GOMODCACHE:-$root/go-mod}
# -modcacherw: the module cache can be deleted with rm -rf. -mod=readonly: go.mod/go.sum are the pins,
# a build never edits them. GOTOOLCHAIN=local: build with the machine's Go, never fetch another.
export GOFLAGS="-modcacherw -mod=readonly"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOWORK=off

say "building Kubernetes into $bin (Go $goversion, nice -n 19; a cold build takes a while)"
say "GOCACHE=$GOCACHE GOMODCACHE=$GOMODCACHE"
start=$(date +%s)

# The version that kube-apiserver, the kubelet (node status) and `kubectl version` report. The
# Kubernetes build stamps it with -X (hack/lib/version.sh); without it they say v0.0.0-master.
k8s_version=$(cd "$MOD" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
build_date=$(cd "$MOD" && go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done
crictl_version=$(cd "$MOD/crictl" && go list -m -f '{{.Version}}' sigs.k8s.io/cri-tools)
coredns_version=$(cd "$MOD/coredns" && go list -m -f '{{.Version}}' github.com/coredns/coredns)
lpp_version=$(cd "$MOD/local-path-provisioner" && go list -m -f '{{.Version}}' github.com/rancher/local-path-provisioner)

partial=$dir/bin.partial
rm -rf "$partial"
mkdir -p "$partial"

# One go build for the Kubernetes commands and etcd: they share most packages. Tags as in
# hack/lib/golang.sh for release builds (selinux,notest,grpcnotrace). etcd's main package is the
# server module itself; go names that binary "server".
(
  cd "$MOD"
  nice -n 19 go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$partial/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy \
    go.etcd.io/etcd/server/v3
)
mv "$partial/server" "$partial/etcd"
(
  cd "$MOD/crictl"
  nice -n 19 go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$crictl_version" \
    -o "$partial/crictl" sigs.k8s.io/cri-tools/cmd/crictl
)
(
  cd "$MOD/coredns"
  nice -n 19 go build -trimpath -ldflags "-s -w" -o "$partial/coredns" .
)
# Its version is a variable of its main package, 0.0.1 unless stamped (as its own Makefile does).
(
  cd "$MOD/local-path-provisioner"
  nice -n 19 go build -trimpath -ldflags "-s -w -X main.VERSION=$lpp_version" \
    -o "$partial/local-path-provisioner" github.com/rancher/local-path-provisioner
)

# Each binary must run and say its version.
versions=$(
  "$partial/kube-apiserver" --version
  "$partial/etcd" --version | head -n1
  "$partial/crictl" --version
  "$partial/coredns" -version | head -n1
  "$partial/local-path-provisioner" --version
)
if ! grep -qx "CoreDNS-${coredns_version#v}" <<<"$versions"; then
  say "coredns -version does not say CoreDNS-${coredns_version#v}"
  exit 1
fi
for b in kube-controller-manager kube-scheduler kubelet kube-proxy; do
  got=$("$partial/$b" --version)
  if [ "$got" != "Kubernetes $k8s_version" ]; then
    say "$b --version said '$got', expected 'Kubernetes $k8s_version'"
    exit 1
  fi
done

rm -rf "$bin"
mv "$partial" "$bin"
elapsed=$(( $(date +%s) - start ))
{
  echo "$versions" | tr '\n' ';' | sed 's/;$//; s/;/; /g'
  echo
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${elapsed}s with $goversion, recipe $RECIPE"
} > "$stamp"
say "built in ${elapsed}s: $bin ($(head -n1 "$stamp"))"
echo "$bin"
