#!/usr/bin/env bash
# `make test-deps`: install the Debian packages the tests need (tests/debian-packages.txt) that are missing,
# as root where apt-get exists; otherwise stop with the one command that installs them.
set -euo pipefail
list="$(dirname "$0")/debian-packages.txt"
packages=$(grep -v '^#' "$list" | awk 'NF {print $1}')
missing=()
for package in $packages; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
((${#missing[@]})) || { echo "test-deps: all $(echo $packages | wc -w) Debian packages the tests need are installed"; exit 0; }
install="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test-deps: installing ${missing[*]}"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive $install
elif command -v apt-get >/dev/null; then
    echo "test-deps: the tests need Debian packages that are missing; run: sudo $install" >&2
    exit 2
else
    echo "test-deps: the tests start real services from Debian's packages (${missing[*]}): run them on Debian 12" >&2
    exit 2
fi
