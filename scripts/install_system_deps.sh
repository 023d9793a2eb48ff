#!/usr/bin/env bash
# Debian packages the test suite uses beyond Python, a C compiler and Go. Installed only when
# missing and only where we may (root with apt-get); elsewhere the tests that need them skip and
# name the package.
#   prometheus: promtool, for `promtool check rules` / `promtool test rules` (tests/test_alerts.py)
set -euo pipefail

need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
for extra in "$@"; do
    dpkg -s "$extra" >/dev/null 2>&1 || need+=("$extra")
done
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system deps: not installing ${need[*]} (needs root and apt-get); the tests that use them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
if ! apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi
echo "system deps: installed ${need[*]} in $(( $(date +%s) - start )) s" >&2
