#!/usr/bin/env bash
# Everything `python -m e2e.localkube up` needs on a fresh Debian machine (make setup-kube runs it):
# the node's Debian packages (containerd, runc, the CNI plugins, iptables, conntrack, ...; the image's
# tools, debootstrap and podman, are installed by scripts/build-image.sh when it first runs), then the
# Kubernetes binaries built from Kubernetes' own Go modules (scripts/ensure-kubernetes.sh: about 12
# minutes the first time, a no-op while the pins are unchanged) and kube-router, the node's NetworkPolicy
# controller (scripts/ensure-network-policies.sh: about 3 minutes the first time). Running it again is a
# no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "ensure-localkube: $*" >&2; }

# program -> the Debian package that has it (as e2e/localkube/binaries.py checks them)
declare -A PACKAGES=(
  [containerd]=containerd [runc]=runc [/usr/lib/cni/bridge]=containernetworking-plugins
  [iptables]=iptables [conntrack]=conntrack [ip]=iproute2 [catatonit]=catatonit
  [busybox]=busybox-static [findmnt]=util-linux [ipset]=ipset
)
missing=()
for program in "${!PACKAGES[@]}"; do
  if [[ $program == /* ]]; then [ -e "$program" ] || missing+=("${PACKAGES[$program]}")
  else PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH" command -v "$program" >/dev/null 2>&1 || missing+=("${PACKAGES[$program]}")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    say "missing Debian packages: ${missing[*]}; install them as root (apt-get install ${missing[*]})"
    exit 1
  fi
  say "installing ${missing[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
bash scripts/ensure-kubernetes.sh >/dev/null
bash scripts/ensure-network-policies.sh >/dev/null
say "ready: the node's packages, $(bash scripts/ensure-kubernetes.sh --check) and $(bash scripts/ensure-network-policies.sh --check)"
