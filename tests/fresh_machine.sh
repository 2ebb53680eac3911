#!/usr/bin/env bash
# The fresh-machine proof of issue 31: a clean Debian 12 chroot bootstrapped as the image test bootstraps
# its base (tests/test_image.py: mmdebstrap --variant=minbase, Python and CA certificates only, plus make
# and git, which the README's commands need), a fresh clone of this checkout's HEAD, the README's set-up
# command, then the tiers: units, ranks, end-to-end, services. The image test needs a Docker daemon of its
# own and stays on the host (`make test-image`). Each step's wall time goes to $LOG.
#
# As root on a Debian host with mmdebstrap and network access to deb.debian.org and PyPI (the set-up
# downloads the pinned wheels, a few GiB): bash tests/fresh_machine.sh [ROOT]
# SKIP="units ranks" skips those steps by name (to rerun the later tiers of an existing ROOT after a fix).
# The shared folder (datasets, vendored LBANN front end) is bind-mounted read-only at /shared, beside the
# clone at /repro, where the kit and the tests look for ../shared; it is never copied.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-$(mktemp -d /tmp/repro-fresh.XXXXXX)}
shared=$(cd "$repo/.." && pwd)/shared
LOG=${LOG:-$root.log}
[ "$(id -u)" = 0 ] || { echo "fresh_machine.sh: run as root (mmdebstrap, chroot, mounts)" >&2; exit 2; }
command -v mmdebstrap >/dev/null || { echo "fresh_machine.sh: needs mmdebstrap: apt-get install mmdebstrap" >&2; exit 2; }

step() {  # step NAME COMMAND...: run it, log its wall time and exit code, stop at the first failure
    local name=$1 start code=0; shift
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped (SKIP)" | tee -a "$LOG"; return 0 ;; esac
    start=$(date +%s)
    echo "== $name: $*" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG" || code=$?
    echo "== $name: exit $code after $(( $(date +%s) - start )) s" | tee -a "$LOG"
    return "$code"
}

in_root() {  # the command as a user of the fresh machine: in the clone, with a plain environment
    chroot "$root" env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 bash -c "cd /repro && $*"
}

unmount() {
    for mount in ${indexes:-} shared tmp dev/pts dev sys proc; do
        mountpoint -q "$root/${mount#/}" && umount -l "$root/${mount#/}"
    done
}
trap unmount EXIT

[ -e "$root/usr/bin/python3" ] ||
    step bootstrap mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,make,git \
        bookworm "$root"
[ -d "$root/repro" ] || step clone git clone --quiet "$repo" "$root/repro"  # committed files only, as a clone has
cp /etc/resolv.conf /etc/hosts "$root/etc/"  # the machine's name resolves (torchrun's rendezvous binds to it)
# This network's settings, which a fresh machine here has too and the kit does not provide: the CA that signs
# its TLS (the egress proxy), and pip's configuration (global, site and root's) with the local indexes it names.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
pip_configs=$(ls /etc/pip.conf /etc/xdg/pip/* /root/.config/pip/pip.conf 2>/dev/null || true)
for config in $pip_configs; do mkdir -p "$root$(dirname "$config")" && cp "$config" "$root$config"; done
indexes=$(cat $pip_configs /dev/null | sed -n 's/^ *\(find-links\|extra-index-url\) *= *//p' | tr ' ' '\n' |
    sed -n 's|^file://||; s|/simple$||; /^\//p' | sort -u)
mkdir -p "$root/shared"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/tmp"
mount --bind -o ro "$shared" "$root/shared"
for index in $indexes; do mkdir -p "$root$index" && mount --bind -o ro "$index" "$root$index"; done

started=$(date +%s)
step setup in_root make setup  # the README's set-up command
step test-deps in_root make test-deps  # as root where apt exists: the Debian packages the tests need
step units in_root make test-fast
step ranks in_root make test-ranks
step end-to-end in_root make test-end-to-end
step services in_root make test-services PYTEST_ARGS=--ignore=tests/test_image.py
echo "fresh machine: every tier passed in $(( $(date +%s) - started )) s (set-up included); log: $LOG" | tee -a "$LOG"
