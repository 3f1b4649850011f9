#!/usr/bin/env bash
# The H200 device check, as the device tool runs it (after `bash loadtest/gpu/prepare.sh` here):
#     run(command="bash loadtest/gpu/check.sh", carry=[".gpu-wheels"], timeout_s=600)
# Everything ends inside 540 s; $OUT gets results.json, results.md (rewritten as each piece
# ends), check.log, kernel_tests.log and server.log. Extra arguments go to check.py (e.g.
# `--only decode_8b` to rerun one piece on a machine still warm).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/tinyserve-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"${PYTHON:-python3}" loadtest/gpu/check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
