#!/bin/sh
# Install pgherd into a new virtualenv: the one way the image does it (Dockerfile) and the packaging
# tests do it (tests/packaging/test_install.py runs this very script), so the two cannot drift.
#
#   scripts/install-pgherd.sh SRC VENV [EXTRAS]
#
# SRC is a source tree (pyproject.toml, README.md, constraints.txt, operator/, backup/), VENV a
# virtualenv to create, EXTRAS a comma-separated list such as `sandbox` (none: the operator, the agent
# and `pgherd-backup`, as in the image). The wheel is built first and installed from the wheel alone,
# which is what `pip install SRC` does; constraints.txt pins the dependencies to the versions `make
# test` ran with. PYTHON chooses the interpreter (default python3, which must be 3.11 or newer).
set -eu

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: $0 SRC VENV [EXTRAS]" >&2
    exit 2
fi
src=$(cd "$1" && pwd)
venv=$2
extras=${3:+[$3]}

"${PYTHON:-python3}" -m venv "$venv"
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
"$venv/bin/pip" wheel --no-deps --wheel-dir "$dist" "$src"
set -- "$dist"/pgherd-*.whl
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
    echo "$0: expected one pgherd wheel in $dist" >&2
    exit 1
fi
"$venv/bin/pip" install --constraint "$src/constraints.txt" "$1$extras"
