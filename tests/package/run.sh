#!/usr/bin/env bash
# The Debian package on a systemd host: builds it (scripts/package), boots a
# Debian 12 container with systemd as PID 1 (systemd-nspawn, a volatile overlay
# over a cached debootstrap), installs the package there and checks what an
# operator relies on: the unit reaches READY (Type=notify), sockets and their
# permissions, `systemctl reload` after a config change (a namespace added, seen
# through udrive's own initiator), a live upgrade to a newer package, a libvirt
# domain on a udrive disk (libvirt.sh), and a purge that leaves nothing behind.
# Ends with `N passed, M failed`; root only.
# UDRIVE_VM_TESTS=0 skips it, as the VM tests.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
TAG=package
CACHE=${UDRIVE_VM_CACHE:-/var/cache/udrive-vm}
# shellcheck source=../vm/lib.sh
source "$root/tests/vm/lib.sh"
# shellcheck source=libvirt.sh
source "$root/tests/package/libvirt.sh"

CHROOT=$CACHE/bookworm-systemd
# What the container needs beyond minbase: systemd as init, and the libraries
# udrive links (the package's Depends are checked by dpkg, not fetched).
# libvirt comes after debootstrap, through apt-get in the chroot: debootstrap
# configures packages in an order that fails polkitd (libvirt's dependency) before
# logind is set up.
BASE_PKGS=systemd,systemd-sysv,dbus,adduser,librbd1,librados2,libcryptsetup12,procps
PKGS=$BASE_PKGS,$LIBVIRT_PKGS
NSPAWN_PID=''
pass=0 fail=0
ok() { say "ok: $*"; pass=$((pass + 1)); }
bad() { say "FAILED: $*"; fail=$((fail + 1)); }
check() { # check WHAT CMD...: CMD must succeed
    local what=$1
    shift
    if "$@" >"$TMP/check.log" 2>&1; then ok "$what"; else bad "$what: $(tail -n 5 "$TMP/check.log")"; fi
}

vm_begin "$CHROOT"
package_cleanup() {
    [ -n "$NSPAWN_PID" ] && kill -TERM "$NSPAWN_PID" 2>/dev/null && { sleep 2; kill -KILL "$NSPAWN_PID" 2>/dev/null; }
    vm_cleanup
}
trap package_cleanup EXIT

phase "build the package (two versions)"
command -v systemd-nspawn >/dev/null || apt_install_host systemd-container
command -v man >/dev/null || apt_install_host man-db
# UDRIVE_PACKAGE_PROFILE=dev packages the binary the tests built (scripts/test).
profile=${UDRIVE_PACKAGE_PROFILE:-release}
for v in 1 2; do
    deb=$(bash "$root/scripts/package" --version "0.1.0-$v" --profile "$profile") || die "scripts/package failed"
    cp "$deb" "$TMP/udrive_$v.deb"
done
command -v lintian >/dev/null || apt_install_host lintian
# Justified in docs/operators.md: a locally built package has no maintainer address
# and no Debian changelog (its history is git's), and the postinst asks systemctl
# whether the unit runs before it hands over live.
check "lintian: no other tag" lintian --suppress-tags bogus-mail-host,no-changelog,maintainer-script-calls-systemctl \
    --fail-on error,warning,info "$TMP/udrive_2.deb"
check "man page renders" sh -c "man -l '$root/dist/generated/man/udrive-serve.1.gz' | grep -q -- '--config'"
check "bash completion loads" bash -c "source '$root/dist/generated/completions/udrive' && complete -p udrive"

phase "boot a systemd container"
[ -f "$CHROOT/.udrive-vm-ready" ] || ensure_chroot "$CHROOT" bookworm "$BASE_PKGS"
ensure_chroot "$CHROOT" bookworm "$PKGS"
systemd-nspawn -q -D "$CHROOT" --volatile=overlay --register=no --keep-unit \
    --bind="$TMP:/pkg" -b >"$TMP/container.log" 2>&1 &
NSPAWN_PID=$!
init=''
for _ in $(seq 1 100); do
    init=$(pgrep -P "$NSPAWN_PID" | head -n1)
    [ -n "$init" ] && [ "$(cat "/proc/$init/comm" 2>/dev/null)" = systemd ] && break
    sleep 0.2
done
[ -n "$init" ] || die "the container did not start (log: $TMP/container.log)"
in_box() { nsenter -t "$init" -a "$@"; }
for _ in $(seq 1 150); do
    st=$(in_box systemctl is-system-running 2>/dev/null)
    case $st in running | degraded) break ;; esac
    sleep 0.2
done
say "container: systemd $st"

phase "install"
check "dpkg -i" in_box dpkg -i /pkg/udrive_1.deb
check "unit active (READY sent)" in_box systemctl is-active --quiet udrive
check "status line from the service" sh -c "nsenter -t $init -a systemctl show -p StatusText udrive | grep -q 'serving 0 device'"
check "runs as user udrive" sh -c "nsenter -t $init -a ps -o user= -C udrive | grep -qx udrive"
check "control socket 0600 udrive" sh -c "nsenter -t $init -a stat -c '%a %U' /run/udrive/rpc.sock | grep -qx '600 udrive'"

phase "reload with a new controller and disk"
in_box sh -c 'for f in t n; do truncate -s 64M /var/lib/udrive/$f.img; done; chown udrive: /var/lib/udrive/*.img'
# File disks: a ram disk's data would not move with the live upgrade below.
in_box sh -c 'cat >>/etc/udrive/udrive.toml' <<'TOML'
[[controller]]
socket = "/run/udrive/t-nvme.sock"
namespaces = ["file:/var/lib/udrive/n.img"]

[[vhost_user_blk]]
socket = "/run/udrive/t-disk.sock"
disk = "file:/var/lib/udrive/t.img"
TOML
check "systemctl reload" in_box systemctl reload udrive
check "device sockets 0660 group kvm" sh -c "nsenter -t $init -a stat -c '%a %G' /run/udrive/t-nvme.sock /run/udrive/t-disk.sock | sort -u | grep -qx '660 kvm'"
check "verified I/O on the added NVMe namespace" in_box udrive perf --vfio-user /run/udrive/t-nvme.sock --rw randrw --qd 4 --time 1 --verify
check "verified I/O on the added file disk (io_uring under the unit's hardening)" \
    in_box udrive perf --vhost-user /run/udrive/t-disk.sock --rw randrw --qd 4 --time 1 --verify
check "journal: a device's lines carry its socket as a field" sh -c "nsenter -t $init -a journalctl -u udrive -o verbose --no-pager | grep -q '^    SOCKET=/run/udrive/t-'"
in_box sh -c 'echo "bogus = 1" >>/etc/udrive/udrive.toml'
if in_box systemctl reload udrive >/dev/null 2>&1; then bad "a broken config reloads"; else ok "a broken config is refused"; fi
check "still serving after the refused reload" in_box systemctl is-active --quiet udrive
in_box sed -i '/^bogus = 1$/d' /etc/udrive/udrive.toml

phase "upgrade under verified I/O"
old=$(in_box systemctl show -p MainPID --value udrive)
invocation=$(in_box systemctl show -p InvocationID --value udrive)
in_box udrive perf --vfio-user /run/udrive/t-nvme.sock --rw randrw --qd 4 --time 12 --verify \
    >"$TMP/perf-upgrade.log" 2>&1 &
perf_pid=$!
sleep 3
check "dpkg -i (upgrade)" in_box dpkg -i /pkg/udrive_2.deb
cp "$TMP/check.log" "$TMP/dpkg-upgrade.log"
check "the postinst handed over live" grep -q "udrive upgrade: pid .* serves" "$TMP/dpkg-upgrade.log"
wait "$perf_pid"
perf_rc=$?
if [ "$perf_rc" = 0 ]; then ok "client's verified I/O ran through the upgrade"; else bad "I/O across the upgrade (rc $perf_rc): $(tail -n 5 "$TMP/perf-upgrade.log")"; fi
new=$(in_box systemctl show -p MainPID --value udrive)
say "main pid $old -> $new"
if [ -n "$new" ] && [ "$new" != 0 ] && [ "$new" != "$old" ]; then ok "the unit's main pid moved to the new server"; else bad "main pid $old -> $new"; fi
check "active after the upgrade" in_box systemctl is-active --quiet udrive
check "no restart: the same invocation of the unit" sh -c "nsenter -t $init -a systemctl show -p InvocationID --value udrive | grep -qx '$invocation'"
check "config kept on upgrade" in_box grep -q t-nvme.sock /etc/udrive/udrive.toml

libvirt_test

phase "purge"
check "dpkg --purge" in_box dpkg --purge udrive
check "service gone" sh -c "! nsenter -t $init -a systemctl is-active --quiet udrive"
check "user and group removed" sh -c "! nsenter -t $init -a getent passwd udrive && ! nsenter -t $init -a getent group udrive"
check "nothing left in /etc, /run, /usr" sh -c "! nsenter -t $init -a ls -d /etc/udrive /run/udrive /usr/bin/udrive /usr/share/doc/udrive /lib/systemd/system/udrive.service 2>/dev/null | grep -q ."
check "disk images kept" in_box test -f /var/lib/udrive/t.img
phase ""
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
