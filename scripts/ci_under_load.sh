#!/usr/bin/env bash
# CI's own run (.ci/run, the README's test command) on a fresh clone of HEAD, beside CPU hogs:
# CI's 2-core machine may be busy, and the whole suite must hold there (issue 38).
#
#   scripts/ci_under_load.sh [HOGS]        (default 2; log in the clone's ci-under-load.log)
#
# Each hog is a shell spinning on one core, started here and killed on any exit.
set -u
HOGS=${1:-2}
SRC=$(git rev-parse --show-toplevel)
REV=$(git -C "$SRC" rev-parse --short HEAD)
CLONE=$(mktemp -d /tmp/gpufence-ci-load.XXXXXX)
git clone --quiet "$SRC" "$CLONE/repo" || exit 1
LOG="$CLONE/ci-under-load.log"

hogs=()
stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
    hogs=()
}
trap stop_hogs EXIT
for _ in $(seq "$HOGS"); do
    sh -c 'while :; do :; done' &
    hogs+=("$!")
done
echo "ci-under-load: .ci/run on a fresh clone of $REV in $CLONE/repo beside $HOGS CPU hogs (pids ${hogs[*]}); log $LOG"
begin=$(date +%s)
(cd "$CLONE/repo" && .ci/run) >"$LOG" 2>&1
rc=$?
took=$(($(date +%s) - begin))
echo "ci-under-load: rc=$rc after ${took}s beside $HOGS hogs: $(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -n 1)"
exit "$rc"
