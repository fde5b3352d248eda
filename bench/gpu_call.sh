#!/usr/bin/env bash
# One device call: bench/gpu_session.sh's stages under one time limit, with everything they
# wrote packed into $OUT/session.tgz (a device call brings back only a few files).
# Usage: PURLIN_COMMIT=<sha> bash bench/gpu_call.sh SECONDS stage [stage ...]
set -uo pipefail
limit=$1; shift
back=${OUT:-out}
export OUT=/tmp/purlin-session
mkdir -p "$OUT" "$back"
timeout --kill-after=5 "$limit" bash bench/gpu_session.sh "$@" 2>&1 | tee "$OUT/session.log"
tar czf "$back/session.tgz" -C "$OUT" .
ls -la "$back"
