#!/usr/bin/env bash
# Build the pgherd image from the Dockerfile without Docker and without a container registry, and write
# it as an archive that containerd imports (`ctr -n k8s.io images import`), e.g. for the local
# Kubernetes of e2e/localkube. Needs root (debootstrap, rootful podman) on Debian or Ubuntu.
#
#   scripts/build-image.sh [--tag TAG] [--pg-major N] [--extra-majors "M ..."]
#                          [--oci-archive PATH | --docker-archive PATH] [--import-into SOCKET] [--rebuild-base]
#
# 1. The base: a Debian bookworm root made by `debootstrap --variant=minbase bookworm` (apt sources as
#    in Debian's own images: bookworm, bookworm-updates, bookworm-security), kept as a tarball in the
#    cache and imported into podman as localhost/pgherd-base:bookworm-<key>. <key> hashes the recipe
#    (this script's make_base function, the mirror, the architecture): it is made once, then reused.
# 2. The image: `podman build --pull=never --build-arg BASE_IMAGE=<base> --build-arg PG_MAJOR=N` of
#    the Dockerfile, tagged TAG (what the chart's operator Deployment runs; default
#    ghcr.io/pgherd/pgherd:<version of pyproject.toml>) and TAG-pg<N> (what the chart's default
#    postgresImage, <repository>:<tag>-pg{major}, gives the PostgreSQL pods and Jobs of a cluster with
#    postgresVersion N; default N = 16, the examples'). Both are the same image, and it carries the
#    majors of --extra-majors beside N (the Dockerfile's PG_EXTRA_MAJORS; default its own, 14 15 17 18:
#    every major, the image the chart's default postgresImage needs). pip inside the build
#    trusts the host's CA bundle (the one pip's configuration names), given as the build secret
#    `pip-ca`: mounted read-only for the pip steps alone, never stored in the image.
# 3. The archive: `podman save --multi-image-archive --format docker-archive` (both names) by default,
#    or `--format oci-archive` (one name, TAG-pg<N>) with --oci-archive. It is rewritten only when
#    the image changed. --import-into SOCKET also imports it into that containerd (namespace k8s.io;
#    from an OCI archive, TAG is then added there by `ctr images tag`).
#
# Tools installed with apt-get when missing: debootstrap, debian-archive-keyring, podman and
# containernetworking-plugins (podman's RUN steps need the CNI bridge; podman build is buildah
# inside, so buildah itself is not needed). Cache: ${PGHERD_IMAGE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/
# pgherd/images}. Mirrors: PGHERD_DEBIAN_MIRROR, PGHERD_DEBIAN_SECURITY_MIRROR. The last two lines on
# stdout are `image NAME...` and `archive PATH`; everything else goes to stderr.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${PGHERD_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pgherd/images}
MIRROR=${PGHERD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${PGHERD_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
SUITE=bookworm

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

usage() {
    sed -n '7,8p' "$0" | sed 's/^#  //' >&2
    exit 2
}

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml" | head -1)
tag=ghcr.io/pgherd/pgherd:${version:-dev}
pg_major=16
extra_majors=default
format=docker-archive
archive=""
import_into=""
rebuild_base=false
while [ $# -gt 0 ]; do
    case $1 in
        --tag) tag=${2:?--tag needs a value}; shift 2 ;;
        --pg-major) pg_major=${2:?--pg-major needs a value}; shift 2 ;;
        --extra-majors) extra_majors=${2?--extra-majors needs a value (may be "")}; shift 2 ;;
        --oci-archive) format=oci-archive; archive=${2:?--oci-archive needs a path}; shift 2 ;;
        --docker-archive) format=docker-archive; archive=${2:?--docker-archive needs a path}; shift 2 ;;
        --import-into) import_into=${2:?--import-into needs a containerd socket}; shift 2 ;;
        --rebuild-base) rebuild_base=true; shift ;;
        -h | --help) usage ;;
        *) log "unknown argument: $1"; usage ;;
    esac
done
case $pg_major in '' | *[!0-9]*) die "--pg-major must be a PostgreSQL major version such as 16" ;; esac
case ${tag##*/} in *:*) ;; *) tag=$tag:latest ;; esac
pg_tag=$tag-pg$pg_major
[ "$(id -u)" -eq 0 ] || die "run as root: debootstrap and rootful podman need it"

# --- tools -------------------------------------------------------------------------------------------

missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
command -v podman >/dev/null || missing+=(podman)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9 # one build at a time per cache (and podman storage)

# --- the base ----------------------------------------------------------------------------------------

arch=$(dpkg --print-architecture)

# Writes a minbase root of Debian $SUITE to the tarball $1. Its text is part of the cache key.
make_base() {
    local tarball=$1 work
    work=$(mktemp -d "$CACHE/base.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    log "debootstrap --variant=minbase $SUITE ($MIRROR, $arch): about a minute"
    if ! debootstrap --variant=minbase --arch="$arch" "$SUITE" "$work/root" "$MIRROR" \
        >"$work/debootstrap.log" 2>&1; then
        tail -20 "$work/debootstrap.log" >&2
        die "debootstrap failed (log above)"
    fi
    local root=$work/root
    rm -f "$root/etc/apt/sources.list"
    cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # As Debian's own container images (debian:bookworm-slim, the official postgres image's base):
    # apt keeps no downloaded package or cache in a layer, and dpkg installs no documentation,
    # manual or translation (copyright files excepted).
    cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
    echo 'Acquire::GzipIndexes "true";' >"$root/etc/apt/apt.conf.d/docker-gzip-indexes"
    cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
    find "$root/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
    find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$root"/usr/share/groff/* "$root"/usr/share/info/* "$root"/usr/share/linda/* \
        "$root"/usr/share/lintian/overrides/* "$root"/usr/share/locale/* "$root"/usr/share/man/*
    # The host's resolver and name never go into the image (podman and the kubelet provide them),
    # nor the downloaded packages and lists.
    rm -f "$root/etc/resolv.conf" "$root/etc/hostname" "$root/var/log/bootstrap.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    tar --numeric-owner --sort=name --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
        -C "$root" -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$work"
    trap - EXIT
}

base_key=$(
    {
        declare -f make_base
        printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY_MIRROR" "$arch"
    } | sha256sum | cut -c1-16
)
base_dir=$CACHE/base-$SUITE-$base_key
base_tar=$base_dir/rootfs.tar
base_image=localhost/pgherd-base:$SUITE-$base_key
if $rebuild_base; then
    rm -rf "$base_dir"
    podman rmi --force "$base_image" >/dev/null 2>&1 || true
fi
if [ ! -f "$base_tar" ]; then
    mkdir -p "$base_dir"
    started=$SECONDS
    make_base "$base_tar"
    log "base made in $((SECONDS - started)) s: $base_tar ($(du -h "$base_tar" | cut -f1))"
fi
if ! podman image exists "$base_image"; then
    log "importing the base as $base_image"
    podman import --quiet \
        --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD=["bash"]' \
        --message "debootstrap --variant=minbase $SUITE ($MIRROR)" \
        "$base_tar" "$base_image" >/dev/null
fi

# --- the image ---------------------------------------------------------------------------------------

# The CA bundle pip uses on this host: $PIP_CERT, else the `cert` of pip's configuration, else the
# system bundle. The network here presents its own CA, which that bundle carries.
ca=${PIP_CERT:-}
if [ -z "$ca" ]; then
    for python in "$REPO/.venv/bin/python" python3; do
        ca=$("$python" -m pip config list 2>/dev/null \
            | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -1) || true
        [ -z "$ca" ] || break
    done
fi
[ -n "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
secret=()
if [ -s "$ca" ]; then
    secret=(--secret "id=pip-ca,src=$ca")
else
    log "no CA bundle at $ca: pip in the build uses the image's own"
fi

extra=()
if [ "$extra_majors" != default ]; then extra=(--build-arg "PG_EXTRA_MAJORS=$extra_majors"); fi
log "building $tag and $pg_tag (PostgreSQL $pg_major, extra majors: $extra_majors) on $base_image"
started=$SECONDS
# --pull=never: the base is local and no registry is reachable. The build's RUN steps keep the
# host's resource limits (a host without CAP_SYS_RESOURCE cannot raise them), so no --ulimit here;
# `podman run` of the result needs `--ulimit nofile=1024:1024 --ulimit nproc=1024:1024` (or
# `--ulimit host`) on such a host, since its defaults are higher than the host's.
podman build --pull=never --layers \
    --file "$REPO/Dockerfile" \
    --build-arg "BASE_IMAGE=$base_image" \
    --build-arg "PG_MAJOR=$pg_major" \
    "${extra[@]}" \
    "${secret[@]}" \
    --tag "$tag" --tag "$pg_tag" \
    "$REPO" >&2
image_id=$(podman image inspect --format '{{.Id}}' "$pg_tag")
size=$(podman image inspect --format '{{.Size}}' "$pg_tag" | awk '{printf "%.0f MB", $1 / 1e6}')
log "built in $((SECONDS - started)) s: ${image_id:0:12}, $size"

# --- the archive -------------------------------------------------------------------------------------

if [ -z "$archive" ]; then
    name=${tag##*/}
    archive=$CACHE/archives/${name//:/_}-pg$pg_major.$format.tar
fi
mkdir -p "$(dirname "$archive")"
archive=$(cd "$(dirname "$archive")" && pwd)/$(basename "$archive")
if [ "$format" = oci-archive ]; then names=("$pg_tag"); else names=("$tag" "$pg_tag"); fi
stamp="$format ${image_id} ${names[*]}"
if [ -f "$archive" ] && [ "$(cat "$archive.stamp" 2>/dev/null)" = "$stamp" ]; then
    log "archive up to date: $archive"
else
    log "writing $archive ($format)"
    rm -f "$archive" "$archive.stamp"
    if [ "$format" = oci-archive ]; then
        podman save --quiet --format oci-archive --output "$archive.partial" "$pg_tag"
    else
        podman save --quiet --format docker-archive --multi-image-archive \
            --output "$archive.partial" "${names[@]}"
    fi
    mv "$archive.partial" "$archive"
    printf '%s\n' "$stamp" >"$archive.stamp"
fi

if [ -n "$import_into" ]; then
    log "importing into the containerd at $import_into (namespace k8s.io)"
    ctr --address "$import_into" -n k8s.io images import "$archive" >&2
    if [ "$format" = oci-archive ]; then
        ctr --address "$import_into" -n k8s.io images tag --force "$pg_tag" "$tag" >&2
    fi
fi

echo "image ${names[*]}"
echo "archive $archive"
