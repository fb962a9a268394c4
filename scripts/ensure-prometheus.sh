#!/usr/bin/env bash
# Make sure promtool and prometheus exist, built from Prometheus' own Go module
# (github.com/prometheus/prometheus, pinned below): promtool checks and unit-tests the chart's alert
# rules (tests/chart/test_alerts.py), the server evaluates them on localkube.
#
# They go to a cache outside the work tree, one folder per pin:
#   ${PGHERD_PROMETHEUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/prometheus}/<version>-<hash>/bin
# where <hash> covers the version, the Go version and this script's build recipe. A stamp file marks a
# finished build; while the pin is unchanged, running again is a no-op. The Go build cache and module
# cache live in the same cache root (PGHERD_GOCACHE and PGHERD_GOMODCACHE override them). Modules come
# from the Go module proxy (GOPROXY as configured) and are checked against the checksum database,
# nothing else is fetched. Builds run under `nice -n 19`: the machine is shared.
#
# The server is built without its web UI (no `builtinassets` tag: the React app is not in the module
# and is not needed; /api/v1/* is served all the same) and with only the file, http and kubernetes
# service discoveries (remove_all_sd,enable_kubernetes_sd), which halves what there is to compile.
#
# Usage: scripts/ensure-prometheus.sh [--rebuild | --check]
#   --check   build nothing: print the bin folder and exit 0 when it is built, exit 1 otherwise
# Messages go to stderr; the last line on stdout is the bin folder, so that
#   bin=$(scripts/ensure-prometheus.sh)
# works from other scripts.
set -euo pipefail
cd "$(dirname "$0")/.."

# Prometheus 3.16.0; the module's versions are 0.<major><minor>.<patch>. go.sum is not needed: a
# `go install module@version` build uses the module's own go.mod and the checksum database.
PROMETHEUS_MODULE_VERSION=v0.316.0
PROMETHEUS_VERSION=3.16.0
# Bump when the way the binaries are built changes (flags, tags, list of commands): it is part of the
# hash, so an old cache is not reused for a new recipe.
RECIPE=1
TAGS=netgo,remove_all_sd,enable_kubernetes_sd
BINARIES=(prometheus promtool)

rebuild=0
check=0
case "${1:-}" in
  "") ;;
  --rebuild) rebuild=1 ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--rebuild | --check]" >&2; exit 2 ;;
esac

say() { echo "ensure-prometheus: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  say "the go command is missing; install Go (1.26.7 or newer) first"
  exit 1
fi

goversion=$(GOTOOLCHAIN=local go env GOVERSION)
hash=$(echo "recipe $RECIPE $TAGS $goversion $PROMETHEUS_MODULE_VERSION" | sha256sum | cut -c1-12)
root=${PGHERD_PROMETHEUS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/prometheus}
dir=$root/$PROMETHEUS_MODULE_VERSION-$hash
bin=$dir/bin
stamp=$dir/stamp

complete() {
  [ -f "$stamp" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$bin/$b" ] || return 1; done
}

if [ "$check" = 1 ]; then
  if complete; then echo "$bin"; exit 0; fi
  say "not built: $bin (run scripts/ensure-prometheus.sh, or make setup-kube)"
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
# -modcacherw: the module cache can be deleted with rm -rf. GOTOOLCHAIN=local: build with the
# machine's Go, never fetch another (the module asks for 1.26.7).
export GOFLAGS="-modcacherw"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOWORK=off

say "building Prometheus $PROMETHEUS_VERSION into $bin (Go $goversion, nice -n 19; a cold build takes about 3 minutes on 2 cores)"
say "GOCACHE=$GOCACHE GOMODCACHE=$GOMODCACHE"
start=$(date +%s)

build_date=$(go list -m -f '{{.Time.UTC.Format "20060102-15:04:05"}}' \
  "github.com/prometheus/prometheus@$PROMETHEUS_MODULE_VERSION")
pkg=github.com/prometheus/common/version
ldflags="-s -w -X $pkg.Version=$PROMETHEUS_VERSION -X $pkg.Branch=$PROMETHEUS_MODULE_VERSION"
ldflags+=" -X $pkg.BuildUser=pgherd -X $pkg.BuildDate=$build_date"

partial=$dir/bin.partial
rm -rf "$partial"
mkdir -p "$partial"
# One go install for both commands: they share most packages.
GOBIN=$partial nice -n 19 go install -trimpath -tags "$TAGS" -ldflags "$ldflags" \
  "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_MODULE_VERSION" \
  "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_MODULE_VERSION"

# Each binary must run and say the pinned version.
for b in "${BINARIES[@]}"; do
  got=$("$partial/$b" --version 2>&1 | head -n1)
  if [[ $got != "$b, version $PROMETHEUS_VERSION "* ]]; then
    say "$b --version said '$got', expected '$b, version $PROMETHEUS_VERSION ...'"
    exit 1
  fi
done

rm -rf "$bin"
mv "$partial" "$bin"
elapsed=$(( $(date +%s) - start ))
{
  echo "prometheus and promtool $PROMETHEUS_VERSION ($PROMETHEUS_MODULE_VERSION, tags $TAGS)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${elapsed}s with $goversion, recipe $RECIPE"
} > "$stamp"
say "built in ${elapsed}s: $bin ($(head -n1 "$stamp"))"
echo "$bin"
