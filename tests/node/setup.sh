#!/bin/sh
# Install what the node tests need from Debian packages: containerd (the CRI runtime the kubelet
# talks to), runc (what containerd runs containers with), the CNI plugins (pod networking:
# bridge + host-local + loopback) and debootstrap (the gpufence image's root filesystem).
# Called from .ci/run before `make e2e`; idempotent. Without root or apt it says why and exits 0:
# the node tests then skip with their own reason (they check for each binary).
set -eu
PACKAGES="containerd runc containernetworking-plugins debootstrap iptables"
if [ "$(id -u)" != 0 ]; then
    echo "tests/node/setup.sh: not root, not installing $PACKAGES (the node tests will skip)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "tests/node/setup.sh: no apt-get, not installing $PACKAGES (the node tests will skip)" >&2
    exit 0
fi
missing=""
for p in $PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    start=$(date +%s)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: no containerd service is started by the package on a machine
    # without systemd anyway; the tests run their own containerd with their own config and state.
    apt-get install -y -qq --no-install-recommends $missing
    echo "tests/node/setup.sh: installed$missing in $(( $(date +%s) - start )) s" >&2
fi
