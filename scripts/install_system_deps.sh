#!/usr/bin/env bash
# The Debian packages the test suite uses beyond Python, a C compiler and Go, installed when
# missing and only where we may (root with apt-get); elsewhere the tests that need them skip and
# name what is missing. `make test` runs this first; it is idempotent (a second run installs
# nothing and takes milliseconds).
#   prometheus                  promtool: `promtool check/test rules` (tests/deploy/test_alerts.py), and
#                               the server the monitoring scenario scrapes with (tests/integration/monitor)
#   tmux                        a terminal to run `gpufence top` in, as a person would
#                               (tests/integration/monitor/test_top.py)
#   containerd, runc            the node's container runtime (tests/e2e/node); containerd's own
#                               service is never started: the tests run theirs with their own config
#   containernetworking-plugins pod networking on the node: bridge, host-local, loopback
#   debootstrap                 the gpufence image's root filesystem (tests/node/images.py)
#   iptables                    the node's route to the `kubernetes` Service (no kube-proxy)
set -euo pipefail

PACKAGES=(prometheus tmux containerd runc containernetworking-plugins debootstrap iptables)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system deps: not installing ${missing[*]} (needs root and apt-get); the tests that use them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "system deps: installed ${missing[*]} in $(( $(date +%s) - start )) s" >&2
