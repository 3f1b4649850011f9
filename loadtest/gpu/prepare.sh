#!/usr/bin/env bash
# Run HERE (with network to PyPI), before the device check: downloads the wheels the H200
# image lacks (loadtest/gpu/wheels.py: msgspec, llguidance) for CPython 3.12 on manylinux
# x86_64 into .gpu-wheels/ (ignored by git), prints their total size and fails over 50 MiB
# (the device tool carries at most 64 MiB with the working tree). Then, through the device
# tool: run `bash loadtest/gpu/check.sh` with carry [".gpu-wheels"] (docs/results.md,
# "H200 (device check)").
set -euo pipefail
cd "$(dirname "$0")/../.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST=.gpu-wheels
LIMIT_MIB=50

"$PY" loadtest/gpu/wheels.py --check  # every runtime dependency is on the image or carried
read -r -a SPECS <<< "$("$PY" loadtest/gpu/wheels.py --specs)"

rm -rf "$DEST"
mkdir -p "$DEST"
# pip matches each manylinux tag exactly: name the ones these packages publish (msgspec:
# manylinux2014 / 2_17 / 2_28; llguidance: abi3 manylinux_2_31). The image's glibc is newer.
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${SPECS[@]}"

count=$(find "$DEST" -name '*.whl' | wc -l)
if [ "$count" -ne "${#SPECS[@]}" ]; then
    echo "expected ${#SPECS[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
bytes=$(find "$DEST" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
ls -l "$DEST"
awk -v b="$bytes" 'BEGIN {printf "total: %d bytes (%.2f MiB)\n", b, b / 1048576}'
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "the wheels exceed ${LIMIT_MIB} MiB: they would not travel with the working tree" >&2
    exit 1
fi
echo "next, through the device tool: bash loadtest/gpu/check.sh   (carry: [\"$DEST\"])"
