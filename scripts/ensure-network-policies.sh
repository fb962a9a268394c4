#!/usr/bin/env bash
# Make sure the NetworkPolicy implementation e2e/localkube runs on its node exists: kube-router's network
# policy controller (cloudnativelabs/kube-router, the controller k3s embeds: iptables rules and ipsets),
# built from its Go module at the version pinned below by `go install <module>@<version>`, which builds
# with the module's own go.mod and checks every module against the checksum database.
#
# Why not sigs.k8s.io/kube-network-policies, the SIG Network project written for testing Kubernetes: it
# builds here (v0.8.0, 160 s), but its dataplane is an nftables `queue` rule (NFQUEUE to user space),
# and this machine's kernel has no nft_queue (CONFIG_NFT_QUEUE is not set: `nft add rule ... queue num
# 100 bypass` answers "Could not process rule: No such file or directory"); it cannot install a single
# rule. kube-router needs only iptables, ipset and the xt_set match, which this kernel has.
# e2e/localkube/NOTES.md ("NetworkPolicies") has the details.
#
# The binary goes to a cache outside the work tree, one folder per pin:
#   ${PGHERD_NETPOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/network-policies}/<hash>/bin/kube-router
# where <hash> covers the version, the Go version and this script's recipe. The Go build and module
# caches are scripts/ensure-kubernetes.sh's (PGHERD_GOCACHE and PGHERD_GOMODCACHE override them): the
# client-go and friends they share are downloaded once. A stamp marks a finished build; running again
# is then a no-op. About 3 minutes cold on 2 cores.
#
# Usage: scripts/ensure-network-policies.sh [--rebuild | --check]
#   --check   build nothing: print the bin folder and exit 0 when it is built, exit 1 otherwise
# Messages go to stderr; the last line on stdout is the bin folder.
set -euo pipefail
cd "$(dirname "$0")/.."

MODULE=github.com/cloudnativelabs/kube-router/v2
VERSION=v2.1.0
# Bump when the way the binary is built changes: it is part of the hash.
RECIPE=1

rebuild=0
check=0
case "${1:-}" in
  "") ;;
  --rebuild) rebuild=1 ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--rebuild | --check]" >&2; exit 2 ;;
esac

say() { echo "ensure-network-policies: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  say "the go command is missing; install Go (1.26 or newer) first"
  exit 1
fi

goversion=$(GOTOOLCHAIN=local go env GOVERSION)
hash=$(echo "recipe $RECIPE $goversion $MODULE@$VERSION" | sha256sum | cut -c1-16)
root=${PGHERD_NETPOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/network-policies}
kube_root=${PGHERD_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/kubernetes}
dir=$root/$hash
bin=$dir/bin
stamp=$dir/stamp

complete() { [ -f "$stamp" ] && [ -x "$bin/kube-router" ]; }

if [ "$check" = 1 ]; then
  if complete; then echo "$bin"; exit 0; fi
  say "not built: $bin"
  exit 1
fi

mkdir -p "$root"
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

export GOCACHE=${PGHERD_GOCACHE:-$kube_root/go-build}
export GOMODCACHE=${PGHERD_GOMODCACHE:-$kube_root/go-mod}
# -mod=mod: `go install module@version` builds with that module's own go.mod (no work tree module).
export GOFLAGS="-modcacherw -mod=mod"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOWORK=off

say "building $MODULE@$VERSION into $bin (Go $goversion, nice -n 19)"
start=$(date +%s)
partial=$dir/bin.partial
rm -rf "$partial"
mkdir -p "$partial"
ldflags="-s -w -X $MODULE/pkg/version.Version=$VERSION"
GOBIN=$partial nice -n 19 go install -trimpath -ldflags "$ldflags" "$MODULE/cmd/kube-router@$VERSION"

got=$("$partial/kube-router" --version 2>&1 | head -n1 | sed "s|^Running [^ ]* |kube-router |")
if ! grep -q "$VERSION" <<<"$got"; then
  say "kube-router --version said '$got', expected $VERSION"
  exit 1
fi
rm -rf "$bin"
mv "$partial" "$bin"
elapsed=$(( $(date +%s) - start ))
{
  echo "$got"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${elapsed}s with $goversion, recipe $RECIPE"
} > "$stamp"
say "built in ${elapsed}s: $bin ($got)"
echo "$bin"
