#!/usr/bin/env bash
# udrive VM test: boots a Linux guest under QEMU (TCG) on an NVMe controller served
# by `udrive serve` over vfio-user, and checks what the guest reports.
# Entry point: scripts/vm-test. Settings (environment) are listed in tests/vm/README.md.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/vm

CACHE=${UDRIVE_VM_CACHE:-/var/cache/udrive-vm}
SID=$CACHE/sid
SID_PKGS=qemu-system-x86,busybox-static,nvme-cli,fio
NS=${UDRIVE_VM_NS:-ram:1G}
# A second namespace the guest reformats (nvme format) and nothing else uses.
NS2=${UDRIVE_VM_NS2:-ram:64M}
UDRIVE_CPUS=${UDRIVE_VM_UDRIVE_CPUS:-0}
VCPUS=${UDRIVE_VM_VCPUS:-2}
TIMEOUT=${UDRIVE_VM_TIMEOUT:-480}
# 1: the crash-recovery scenario instead: udrive runs under
# `serve --supervise` with a file namespace, the guest (guest-supervise.sh) runs
# fio with verify and twice asks the host to SIGKILL the server process; the guest's
# driver notices within IO_TIMEOUT seconds (nvme_core.io_timeout) and resets.
SUPERVISE=${UDRIVE_VM_SUPERVISE:-0}
IO_TIMEOUT=${UDRIVE_VM_IO_TIMEOUT:-5}
CRASHES=2
# 1: the live-handover scenario instead: udrive runs unsupervised with a
# file namespace, the guest (guest-upgrade.sh) runs fio with verify and asks the
# host UPGRADES times for `udrive upgrade`; it must see a pause, never a reset.
UPGRADE=${UDRIVE_VM_UPGRADE:-0}
UPGRADES=${UDRIVE_VM_UPGRADES:-3}
UPGRADE_JOB_MIB=${UDRIVE_VM_UPGRADE_JOB_MIB:-384} # fio MiB per vCPU
if [ "$UPGRADE" = 1 ]; then
    GUEST_INIT=${UDRIVE_VM_GUEST_INIT:-$here/guest-upgrade.sh}
    NS=${UDRIVE_VM_NS:-} # default: a 1 GiB file in the run directory (below)
    NS2=${UDRIVE_VM_NS2:-}
    LAST_PHASE=1
    DEFAULT_IDLE=0
elif [ "$SUPERVISE" = 1 ]; then
    GUEST_INIT=${UDRIVE_VM_GUEST_INIT:-$here/guest-supervise.sh}
    NS=${UDRIVE_VM_NS:-} # default: a 1 GiB file in the run directory (below)
    NS2=${UDRIVE_VM_NS2:-}
    LAST_PHASE=1
    DEFAULT_IDLE=0
else
    GUEST_INIT=${UDRIVE_VM_GUEST_INIT:-$here/guest-init.sh}
    LAST_PHASE=2
    DEFAULT_IDLE=4
fi
# NVMe poll mode of udrive (--poll); the guest idles IDLE_SECS before powering off
# while the host measures udrive's CPU (a reactor that sleeps uses next to none).
POLL=${UDRIVE_VM_POLL:-adaptive}
IDLE_SECS=${UDRIVE_VM_IDLE_SECS:-$DEFAULT_IDLE}
# udrive (default) or qemu-nvme: QEMU's own emulated NVMe instead of udrive, to
# check the harness and guest script themselves (udrive-specific checks then fail).
DEVICE=${UDRIVE_VM_DEVICE:-udrive}
# 1: also a throwaway Ceph cluster; the guest has the host clone a protected RBD
# snapshot and hot-add the clone as namespace 3, writes it and resizes it.
RBD=${UDRIVE_VM_RBD:-0}
# 1: the guest has the host hot-add an encrypted namespace (a LUKS2 volume udrive
# formats, encrypt=luks,create=on) as a namespace and runs fio verify through it;
# the host adds a key over RPC meanwhile and checks the volume with cryptsetup.
# Default: with the RBD pass.
LUKS=${UDRIVE_VM_LUKS:-$RBD}
# Its NSID: after the RBD clone's when there is one.
LUKS_NSID=0
[ "$LUKS" != 1 ] || LUKS_NSID=$((RBD == 1 ? 4 : 3))
# 1: the guest has the host hot-add a qcow2 overlay over a base image qemu-img
# made with known data, runs fio verify rounds on it while the host takes a live
# snapshot and commits it with a pivot (answering on ttyS1), and sends the disk's
# sha256; after udrive exits the host checks the images (`qemu-img check`) and
# that the committed chain holds exactly that. NSID after RBD's and LUKS's.
QCOW2=${UDRIVE_VM_QCOW2:-0}
QCOW2_NSID=0
[ "$QCOW2" != 1 ] || QCOW2_NSID=$((3 + RBD + LUKS))
# Guest RAM: shared (a memfd backend QEMU hands to udrive: the fast path) or private
# (plain `-m`, not fd-backed: QEMU maps it without a file descriptor and udrive
# moves every byte with DMA_READ/DMA_WRITE messages, docs/decisions/0020).
MEM=${UDRIVE_VM_MEM:-shared}
case $MEM in shared | private) ;; *) echo "UDRIVE_VM_MEM must be shared or private, not $MEM" >&2; exit 2 ;; esac
[ "$SUPERVISE" != 1 ] || [ "$RBD" != 1 ] || { echo "UDRIVE_VM_SUPERVISE=1 and UDRIVE_VM_RBD=1 are separate runs" >&2; exit 2; }
[ "$UPGRADE" != 1 ] || { [ "$RBD" != 1 ] && [ "$SUPERVISE" != 1 ]; } ||
    { echo "UDRIVE_VM_UPGRADE=1 is a run of its own (not with UDRIVE_VM_RBD=1 or UDRIVE_VM_SUPERVISE=1)" >&2; exit 2; }

TAG=vm-test
# shellcheck source=tests/vm/lib.sh
source "$here/lib.sh"

vm_begin "$SID"
if { [ "$SUPERVISE" = 1 ] || [ "$UPGRADE" = 1 ]; } && [ -z "$NS" ]; then
    # Data on a file namespace survives the server process; ram: would not (and
    # cannot be handed over).
    truncate -s 1G "$TMP/disk.img"
    NS=file:$TMP/disk.img
fi

# ------------------------------------------------------------ sid chroot
ensure_sid() {
    ensure_chroot "$SID" sid "$SID_PKGS"
    check_qemu "$SID" vfio-user-pci
}

# ------------------------------------------------------------ initramfs
# busybox, nvme-cli and fio from the sid chroot, with the libraries ldd lists.
build_initramfs() {
    local r=$TMP/initramfs
    initramfs_begin "$r" "$SID/usr/bin/busybox"
    initramfs_add_bin "$r" "$SID" /usr/sbin/nvme /usr/bin/fio
    initramfs_pack "$r" "$GUEST_INIT" "$TMP/initramfs.cpio"
    say "initramfs: $(du -m "$TMP/initramfs.cpio" | cut -f1) MiB (busybox, nvme-cli, fio + libraries)"
}

# ------------------------------------------------------------ udrive
start_udrive() {
    local args=(serve --vfio-user "$TMP/nvme.sock" --ns "$NS")
    [ -z "$NS2" ] || args+=(--ns "$NS2")
    args+=(--cpus "$UDRIVE_CPUS" --poll "$POLL" --rpc "$TMP/rpc.sock")
    # SERVER_PID is then the supervisor; server_child finds the server process.
    [ "$SUPERVISE" != 1 ] || args+=(--supervise)
    say "$UDRIVE ${args[*]}"
    NO_COLOR=1 RUST_LOG=${RUST_LOG:-info} setpriv --pdeathsig KILL -- \
        "$UDRIVE" "${args[@]}" >>"$TMP/udrive.log" 2>&1 </dev/null &
    SERVER_PID=$!
    wait_socket "$TMP/nvme.sock" "$SERVER_PID" "$TMP/udrive.log" "udrive serve"
}
# The server process a supervisor (SERVER_PID, `serve --supervise`) runs now; empty
# while it restarts one.
server_child() {
    local kids
    kids=$(cat "/proc/$SERVER_PID/task/$SERVER_PID/children" 2>/dev/null) || return 0
    echo "${kids%% *}"
}

# ------------------------------------------------------------ Ceph
# A cluster in TMP (stopped by vm_cleanup) with image rbd/gold: 64 MiB whose first
# MiB is `yes UDRIVE-RBD-GOLD`, snapshot @base protected for cloning.
start_ceph() {
    ceph_start
    yes UDRIVE-RBD-GOLD | head -c $((1 << 20)) >"$TMP/gold.bin" || true
    truncate -s 64M "$TMP/gold.bin"
    rbd --conf "$CEPH_CONF" import --no-progress "$TMP/gold.bin" rbd/gold
    rbd --conf "$CEPH_CONF" snap create rbd/gold@base
    rbd --conf "$CEPH_CONF" snap protect rbd/gold@base
    say "ceph: $(tail -n 2 "$TMP/ceph.log" | head -n 1 | cut -c1-120); rbd/gold@base protected"
}

# ------------------------------------------------------------ QEMU in the chroot
start_qemu() {
    local mem=1G d=$IN_CHROOT
    : >"$TMP/console.log"
    QEMU_ARGS=(-accel tcg -cpu "$TCG_CPU" -smp "$VCPUS" -m $mem)
    if [ "$MEM" = shared ]; then
        QEMU_ARGS+=(-object memory-backend-memfd,id=mem,size=$mem,share=on -numa node,memdev=mem)
    fi
    QEMU_ARGS+=(
        -bios /usr/share/qemu/qboot.rom -nic none -nographic -monitor none
        -serial "file:$d/console.log"
        -kernel "$d/vmlinuz" -initrd "$d/initramfs.cpio"
        -append "console=ttyS0 quiet edd=off panic=-1 rdinit=/init udrive.idle=$IDLE_SECS udrive.rbd=$RBD udrive.luks=$LUKS_NSID udrive.qcow2=$QCOW2_NSID${CRASH_ARGS:-}"
    )
    if [ "$UPGRADE" = 1 ] || [ "$QCOW2" = 1 ]; then
        # ttyS1: the host's answers to UDRIVE-UPGRADE and UDRIVE-QCOW2-SNAP (tell_guest).
        mkfifo "$TMP/ctl.in" "$TMP/ctl.out"
        QEMU_ARGS+=(-chardev "pipe,id=ctl,path=$d/ctl" -serial chardev:ctl)
    fi
    if [ "$DEVICE" = qemu-nvme ]; then
        truncate -s "${NS#*:}" "$TMP/disk.img"
        QEMU_ARGS+=(-drive "file=$d/disk.img,if=none,id=d0,format=raw,discard=unmap"
            -device nvme,serial=selftest,drive=d0)
    else
        QEMU_ARGS+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"$d/nvme.sock\",\"type\":\"unix\"}}")
    fi
    echo "chroot $SID qemu-system-x86_64 ${QEMU_ARGS[*]}" >"$TMP/qemu.cmd"
    # A private mount namespace holds the chroot's mounts: they disappear with QEMU.
    in_chroot "$SID" /usr/bin/qemu-system-x86_64 "${QEMU_ARGS[@]}" >"$TMP/qemu.log" 2>&1 </dev/null &
    QEMU_PID=$!
}

stop_udrive() {
    if [ "$UPGRADE" = 1 ]; then
        # SERVER_PID, the first process, exited after its handover; the one serving
        # now is not our child (stop_upgraded).
        if [ -n "$SERVER_PID" ] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
            wait "$SERVER_PID" 2>/dev/null && FIRST_RC=0 || FIRST_RC=$?
            SERVER_PID=
            stop_upgraded "$TMP/rpc.sock"
            UDRIVE_RC=$STOP_RC
            LAST_PID=$STOP_PID
            return 0
        fi
    fi
    # A supervisor forwards SIGTERM to its server process and exits with it; should
    # it not, its server process must not outlive the run.
    local kid
    kid=$(server_child)
    stop_pid "$SERVER_PID"
    UDRIVE_RC=$STOP_RC
    SERVER_PID=
    if [ -n "$kid" ] && grep -qa -- --supervised "/proc/$kid/cmdline" 2>/dev/null; then
        kill -KILL "$kid" 2>/dev/null || true
        UDRIVE_RC="$UDRIVE_RC (server process $kid left running)"
    fi
}

# ------------------------------------------------------------ main
phase "setup: sid chroot with QEMU"
ensure_sid
phase "setup: guest kernel"
ensure_kernel
phase "setup: initramfs"
build_initramfs
if [ "$DEVICE" = udrive ]; then
    phase "setup: build udrive"
    build_udrive
fi
if [ "$UPGRADE" = 1 ]; then
    phase "guest run (live handover: $UPGRADES x udrive upgrade under fio, io_timeout ${IO_TIMEOUT}s, guest RAM $MEM)"
    CRASH_ARGS=" nvme_core.io_timeout=$IO_TIMEOUT udrive.dev=nvme0n1 udrive.upgrades=$UPGRADES udrive.job_mib=$UPGRADE_JOB_MIB"
elif [ "$SUPERVISE" = 1 ]; then
    phase "guest run (crash recovery: $CRASHES x SIGKILL under fio, io_timeout ${IO_TIMEOUT}s, guest RAM $MEM)"
    CRASH_ARGS=" nvme_core.io_timeout=$IO_TIMEOUT udrive.crashes=$CRASHES"
else
    phase "guest run (2 boots, guest RAM $MEM)"
fi
if [ "$DEVICE" = udrive ] && [ "$RBD" = 1 ]; then start_ceph; fi
if [ "$DEVICE" = udrive ]; then start_udrive; else say "self-test: QEMU's emulated NVMe, no udrive"; fi
start_qemu
IDLE_T0= IDLE_TICKS0= IDLE_RESULT=
# On the guest's idle markers: udrive's CPU time (utime + stime) over the idle span.
idle_hook() {
    [ -n "${1:-}" ] && [ -n "$SERVER_PID" ] && [ -r "/proc/$SERVER_PID/stat" ] || return 0
    case $1 in
    UDRIVE-IDLE\ begin*)
        IDLE_T0=$EPOCHREALTIME
        IDLE_TICKS0=$(awk '{print $14 + $15}' "/proc/$SERVER_PID/stat") ;;
    UDRIVE-IDLE\ end*)
        [ -n "$IDLE_T0" ] || return 0
        local ticks
        ticks=$(awk '{print $14 + $15}' "/proc/$SERVER_PID/stat")
        IDLE_RESULT=$(awk -v t="$((ticks - IDLE_TICKS0))" -v hz="$(getconf CLK_TCK)" \
            -v s="$(awk -v a="$IDLE_T0" -v b="$EPOCHREALTIME" 'BEGIN{print b - a}')" \
            'BEGIN { printf "%.2f %.1f", t / hz / s * 100, s }') ;;
    esac
}
# On the guest's UDRIVE-RESIZE lines: the resize RPC; its answer is a host result
# (the guest checks that its disk follows).
RESIZES=0
resize_hook() {
    local re='^UDRIVE-RESIZE nsid=([0-9]+) bytes=([0-9]+) shrink=([01])' shrink=false out
    [[ ${1:-} =~ $re ]] || return 0
    local nsid=${BASH_REMATCH[1]} bytes=${BASH_REMATCH[2]}
    [ "${BASH_REMATCH[3]}" = 0 ] || shrink=true
    RESIZES=$((RESIZES + 1))
    local params="{\"socket\":\"$TMP/nvme.sock\",\"nsid\":$nsid,\"size\":$bytes,\"shrink\":$shrink}"
    if out=$("$UDRIVE" rpc --rpc "$TMP/rpc.sock" resize "$params" 2>&1) && grep -q '"notified": true' <<<"$out"; then
        host_result "resize-rpc-$RESIZES" PASS "namespace $nsid to $((bytes / 1048576)) MiB (shrink $shrink), host notified: $(grep -o '"notice": "[^"]*"' <<<"$out" | cut -c1-120)"
    else
        host_result "resize-rpc-$RESIZES" FAIL "namespace $nsid to $bytes bytes (shrink $shrink): $(tr '\n' ' ' <<<"$out" | cut -c1-240)"
    fi
}
# On UDRIVE-RBD-CLONE: clone rbd/gold@base and hot-add it as namespace 3 (RPC);
# on UDRIVE-RBD-DATA: what the guest wrote must be in the image (`rbd export`).
rpc() { "$UDRIVE" rpc --rpc "$TMP/rpc.sock" "$@" 2>&1; }
rbd_hook() {
    local out re='^UDRIVE-RBD-DATA off=([0-9]+) len=([0-9]+) sha256=([0-9a-f]+)'
    case ${1:-} in
    UDRIVE-RBD-CLONE*)
        if out=$(rpc rbd_clone_image "{\"image\":\"rbd/gold\",\"snap\":\"base\",\"clone\":\"rbd/vmclone\",\"conf\":\"$CEPH_CONF\"}") &&
            out=$(rpc nvme_add_namespace "{\"socket\":\"$TMP/nvme.sock\",\"nsid\":3,\"spec\":\"rbd:rbd/vmclone,conf=$CEPH_CONF\"}"); then
            host_result rbd-clone-rpc PASS "rbd/gold@base cloned into rbd/vmclone, hot-added: $(tr -d ' \n' <<<"$out")"
        else
            host_result rbd-clone-rpc FAIL "$(tr '\n' ' ' <<<"$out" | cut -c1-240)"
        fi ;;
    UDRIVE-RBD-DATA*)
        [[ $1 =~ $re ]] || return 0
        local got
        got=$(rbd --conf "$CEPH_CONF" export --no-progress rbd/vmclone - 2>/dev/null |
            tail -c +$((BASH_REMATCH[1] + 1)) | head -c "${BASH_REMATCH[2]}" | sha256sum | cut -d' ' -f1) || true
        if [ "$got" = "${BASH_REMATCH[3]}" ]; then
            host_result rbd-export PASS "the guest's ${BASH_REMATCH[2]} bytes at ${BASH_REMATCH[1]} are in rbd/vmclone (rbd export sha256 ${got:0:16}...)"
        else
            host_result rbd-export FAIL "rbd export sha256 ${got:0:16}..., the guest wrote ${BASH_REMATCH[3]:0:16}..."
        fi ;;
    esac
}
# On UDRIVE-LUKS-ADD: a blank file hot-added as encrypted namespace LUKS_NSID (udrive
# formats it); on UDRIVE-LUKS-KEY (the guest's fio runs): a second key added over
# RPC; on UDRIVE-LUKS-CHECK: cryptsetup opens the volume with either key.
luks_hook() {
    local out spec img=$TMP/luks.img
    case ${1:-} in
    UDRIVE-LUKS-ADD*)
        truncate -s 80M "$img"
        printf 'vm test passphrase' >"$TMP/luks.key"
        printf 'second key' >"$TMP/luks2.key"
        spec=${UDRIVE_VM_LUKS_SPEC:-"file:$img,encrypt=luks,key-file=$TMP/luks.key,create=on"}
        if out=$(rpc nvme_add_namespace "{\"socket\":\"$TMP/nvme.sock\",\"nsid\":$LUKS_NSID,\"spec\":\"$spec\"}"); then
            host_result luks-hot-add PASS "$spec: $(tr -d ' \n' <<<"$out")"
        else
            host_result luks-hot-add FAIL "$(tr '\n' ' ' <<<"$out" | cut -c1-240)"
        fi ;;
    UDRIVE-LUKS-KEY*)
        if out=$(rpc luks_add_key "{\"socket\":\"$TMP/nvme.sock\",\"nsid\":$LUKS_NSID,\"key_file\":\"$TMP/luks.key\",\"new_key_file\":\"$TMP/luks2.key\",\"iter_time_ms\":100}"); then
            host_result luks-add-key-under-io PASS "$(tr -d ' \n' <<<"$out" | grep -o '"keyslots":\[[0-9,]*\]')"
        else
            host_result luks-add-key-under-io FAIL "$(tr '\n' ' ' <<<"$out" | cut -c1-240)"
        fi ;;
    UDRIVE-LUKS-CHECK*)
        if cryptsetup open --test-passphrase --key-file "$TMP/luks.key" "$img" 2>/dev/null &&
            cryptsetup open --test-passphrase --key-file "$TMP/luks2.key" "$img" 2>/dev/null; then
            host_result luks-cryptsetup PASS "cryptsetup opens $img with the first key and the one added under I/O (LUKS$(cryptsetup luksDump "$img" | sed -n 's/^Version:[[:space:]]*//p'))"
        else
            host_result luks-cryptsetup FAIL "cryptsetup does not open $img with both keys"
        fi ;;
    esac
}
# On UDRIVE-QCOW2-ADD: base.qcow2 (32 x the first MiB of `yes UDRIVE-QCOW2-BASE`,
# qemu-img) and
# overlay.qcow2 over it, hot-added as namespace QCOW2_NSID; on UDRIVE-QCOW2-SNAP
# (the guest's fio runs): a live snapshot into snap.qcow2, then an active commit
# of it back into overlay.qcow2 with the pivot (`udrive rpc --wait`), answered on
# ttyS1; on UDRIVE-QCOW2-DATA: the guest's sha256 of the disk, checked by
# qcow2_check once udrive has exited.
QCOW2_SHA=
qcow2_hook() {
    local out q=$TMP/qcow2 ns=\"socket\":\"$TMP/nvme.sock\",\"nsid\":$QCOW2_NSID
    case ${1:-} in
    UDRIVE-QCOW2-ADD*)
        mkdir -p "$q"
        { yes UDRIVE-QCOW2-BASE || true; } | head -c 1M >"$q/chunk"
        for _ in $(seq 32); do cat "$q/chunk"; done >"$q/base.raw"
        if qemu-img convert -q -f raw -O qcow2 "$q/base.raw" "$q/base.qcow2" &&
            qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 "$q/overlay.qcow2" &&
            out=$(rpc nvme_add_namespace "{$ns,\"spec\":\"qcow2:$q/overlay.qcow2\"}"); then
            host_result qcow2-hot-add PASS "overlay.qcow2 over base.qcow2 (qemu-img, 32 MiB of known data): $(tr -d ' \n' <<<"$out")"
        else
            host_result qcow2-hot-add FAIL "$(tr '\n' ' ' <<<"${out:-qemu-img failed}" | cut -c1-240)"
        fi ;;
    UDRIVE-QCOW2-SNAP*)
        if out=$(rpc qcow2_snapshot_create "{$ns,\"path\":\"$q/snap.qcow2\"}"); then
            host_result qcow2-snapshot-under-io PASS "snap.qcow2 over overlay.qcow2, device paused $(tr -d ' \n' <<<"$out" | grep -o '"pause_us":[0-9]*' | cut -d: -f2) us"
        else
            host_result qcow2-snapshot-under-io FAIL "$(tr '\n' ' ' <<<"$out" | cut -c1-240)"
            tell_guest "qcow2 failed: snapshot"
            return 0
        fi
        # Let the guest's writes land in the new overlay before it is committed.
        sleep 2
        if out=$(timeout 120 "$UDRIVE" rpc --rpc "$TMP/rpc.sock" --wait block_commit "{$ns,\"rate\":\"4M\"}" 2>&1) &&
            grep -q '"state": "completed"' <<<"$out" &&
            ! grep -q 'snap.qcow2' <<<"$(rpc get_devices "{\"socket\":\"$TMP/nvme.sock\"}")"; then
            host_result qcow2-commit-under-io PASS "snap.qcow2 committed into overlay.qcow2, pivoted: $(tr -d ' \n' <<<"$out" | grep -oE '"(done|total)":[0-9]*' | tr '\n' ' ')bytes"
            tell_guest "qcow2 done"
        else
            host_result qcow2-commit-under-io FAIL "$(tr '\n' ' ' <<<"$out" | cut -c1-240)"
            tell_guest "qcow2 failed: commit"
        fi ;;
    UDRIVE-QCOW2-DATA*)
        QCOW2_SHA=$(sed -n 's/.*sha256=\([0-9a-f]*\).*/\1/p' <<<"$1") ;;
    esac
}
# After udrive exited (its images closed): every image of the chain passes
# `qemu-img check`, the base is what qemu-img wrote, and the committed overlay over
# it reads as the guest's last sha256 of the disk.
qcow2_check() {
    local q=$TMP/qcow2 img bad='' got base
    [ -f "$q/overlay.qcow2" ] || { host_result qcow2-images FAIL "no overlay.qcow2: the guest did not ask"; return 0; }
    for img in base overlay snap; do
        qemu-img check -q "$q/$img.qcow2" >"$q/check-$img.out" 2>&1 || bad="$bad $img.qcow2 (exit $?: $(tr '\n' ' ' <"$q/check-$img.out" | cut -c1-80))"
    done
    qemu-img convert -f qcow2 -O raw "$q/overlay.qcow2" "$q/overlay.raw" &&
        got=$(sha256sum <"$q/overlay.raw" | cut -d' ' -f1) || got=unreadable
    qemu-img convert -f qcow2 -O raw "$q/base.qcow2" "$q/base-now.raw" &&
        base=$(sha256sum <"$q/base-now.raw" | cut -d' ' -f1) || base=unreadable
    if [ -n "$bad" ]; then
        host_result qcow2-images FAIL "qemu-img check:$bad"
    elif [ "$base" != "$(sha256sum <"$q/base.raw" | cut -d' ' -f1)" ]; then
        host_result qcow2-images FAIL "base.qcow2 changed (sha256 ${base:0:16}...)"
    elif [ -z "$QCOW2_SHA" ] || [ "$got" != "$QCOW2_SHA" ]; then
        host_result qcow2-images FAIL "overlay.qcow2 over base.qcow2 reads sha256 ${got:0:16}..., the guest read ${QCOW2_SHA:-nothing}"
    else
        host_result qcow2-images PASS "qemu-img check clean on base, overlay and snap; base unchanged; the committed overlay holds what the guest read (sha256 ${got:0:16}...)"
    fi
}
# On UDRIVE-CRASH (UDRIVE_VM_SUPERVISE=1): SIGKILL the server process, wait for the
# supervisor's new one (host result server-kill-N), and start a probe that polls
# the new server's get_stats until an I/O command has completed.
KILLS=0 PROBES=()
crash_hook() {
    local re='^UDRIVE-CRASH n=([0-9]+)' old new t0
    [[ ${1:-} =~ $re ]] || return 0
    KILLS=$((KILLS + 1))
    old=$(server_child)
    if [ -z "$old" ]; then
        host_result "server-kill-$KILLS" FAIL "the supervisor (pid $SERVER_PID) runs no server process"
        return 0
    fi
    t0=$EPOCHREALTIME
    kill -KILL "$old" 2>/dev/null || true
    echo "$t0" >"$TMP/kill-$KILLS"
    first_io_probe "$KILLS" "$t0" &
    PROBES+=($!)
    VM_EXTRA_PIDS+=($!)
    new=
    for _ in $(seq 200); do
        new=$(server_child)
        [ -n "$new" ] && [ "$new" != "$old" ] && break
        new=
        sleep 0.025
    done
    if [ -n "$new" ]; then
        host_result "server-kill-$KILLS" PASS "SIGKILL server pid $old -> the supervisor runs pid $new after $(elapsed "$t0") s"
    else
        host_result "server-kill-$KILLS" FAIL "SIGKILL server pid $old: no new server process 5 s later"
    fi
}
# first_io_probe N T0 [BEFORE]: polls get_stats (the new process's counters start
# at zero) until a read or write has completed; writes "SECONDS OPS BEFORE" to
# first-io-N: seconds since T0 when that answer came, and when the last poll that
# saw none began (BEFORE, default 0, if the first poll saw some).
first_io_probe() {
    local n=$1 t0=$2 out ops start before=${3:-0}
    for _ in $(seq 1500); do
        start=$(elapsed "$t0")
        if out=$("$UDRIVE" rpc --rpc "$TMP/rpc.sock" get_stats 2>/dev/null); then
            ops=$(io_ops <<<"$out")
            if [ "${ops:-0}" -gt 0 ]; then
                echo "$(elapsed "$t0") $ops $before" >"$TMP/first-io-$n"
                return 0
            fi
            before=$start
        fi
        sleep 0.05
    done
}
# Completed reads + writes in a get_stats answer: the "ops" objects' read and write
# (0 while the controller has no I/O queues: no "ops" at all).
io_ops() {
    tr -d ' \n' | { grep -oE '"ops":\{[^}]*\}' || true; } | { grep -oE '"(read|write)":[0-9]+' || true; } |
        awk -F: '{ s += $2 } END { print s + 0 }'
}
# On UDRIVE-UPGRADE (UDRIVE_VM_UPGRADE=1): udrive upgrade (host result upgrade-N),
# a probe for the new process's first I/O completion, and the answer on ttyS1.
UPGRADES_DONE=0
upgrade_hook() {
    local re='^UDRIVE-UPGRADE n=([0-9]+)'
    [[ ${1:-} =~ $re ]] || return 0
    UPGRADES_DONE=$((UPGRADES_DONE + 1))
    udrive_upgrade "$UPGRADES_DONE" "$TMP/rpc.sock" "$TMP/udrive.log"
    echo "$UPG_T0 $UPG_SECS ${UPG_OLD:-none} ${UPG_NEW:-none}" >"$TMP/upgrade-$UPGRADES_DONE"
    if [ "$UPG_OK" = 1 ]; then
        first_io_probe "$UPGRADES_DONE" "$UPG_T0" "$UPG_SECS" &
        PROBES+=($!)
        VM_EXTRA_PIDS+=($!)
        tell_guest "upgraded n=$UPGRADES_DONE: pid $UPG_OLD -> $UPG_NEW in $UPG_SECS s"
    else
        tell_guest "failed n=$UPGRADES_DONE: $(cut -c1-200 <<<"$UPG_WHY")"
    fi
}
guest_hook() {
    idle_hook "$@"
    resize_hook "$@"
    [ "$RBD" = 1 ] && rbd_hook "$@"
    [ "$LUKS" = 1 ] && luks_hook "$@"
    [ "$QCOW2" = 1 ] && qcow2_hook "$@"
    [ "$SUPERVISE" = 1 ] && crash_hook "$@"
    [ "$UPGRADE" = 1 ] && upgrade_hook "$@"
    return 0
}
watch_guest "$TMP/console.log" "$TIMEOUT" guest_hook
# The probes finished long ago unless no I/O completed after a crash.
for p in "${PROBES[@]}"; do
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
done
[ "$DEVICE" = udrive ] && stop_udrive
phase ""
[ "$QCOW2" != 1 ] || qcow2_check

# Results: one line per guest check, plus checks made here on the host side.
guest_results "$TMP/console.log"
if grep -aq "^UDRIVE-DONE phase=$LAST_PHASE" "$TMP/console.log" && [ "$QEMU_RC" = 0 ]; then
    host_result guest-completed PASS "$([ "$LAST_PHASE" = 2 ] && echo both boots || echo the boot) finished, QEMU exited 0"
else
    host_result guest-completed FAIL "QEMU exit $QEMU_RC; last marker: $(grep -aE '^UDRIVE-(BOOT|DONE)' "$TMP/console.log" | tail -n1) ${HARNESS_FAIL[*]}"
fi
touch "$TMP/udrive.log"
UDRIVE_RC=${UDRIVE_RC:-not run}
# log_secs N REGEX: seconds from the N-th SIGKILL to the first line of udrive's log
# matching REGEX after the supervisor's N-th restart (log times are UTC RFC 3339).
log_secs() {
    local ts
    ts=$(sed 's/\x1b\[[0-9;]*m//g' "$TMP/udrive.log" |
        awk -v n="$1" -v re="$2" '/the server died/ { c++; next } c == n && $0 ~ re { print $1; exit }')
    [ -n "$ts" ] || return 0
    awk -v a="$(cat "$TMP/kill-$1")" -v b="$(date -d "$ts" +%s.%N)" 'BEGIN { printf "%.3f", b - a }'
}
if [ "$SUPERVISE" = 1 ]; then
    for n in $(seq "$CRASHES"); do
        if [ ! -f "$TMP/kill-$n" ]; then
            host_result "recovery-$n" FAIL "no SIGKILL $n: the guest did not ask"
            continue
        fi
        took=$(log_secs "$n" 'took over the connected client')
        enabled=$(log_secs "$n" 'controller enabled')
        first='' ops='' before=''
        [ ! -f "$TMP/first-io-$n" ] || read -r first ops before <"$TMP/first-io-$n"
        detail="SIGKILL -> new server took the client over ${took:-never} s, -> controller enabled again (the guest's reset) ${enabled:-never} s, -> first I/O completion ${first:+between $before and }${first:-never} s (get_stats: none, then $ops ops)"
        if [ -n "$took" ] && [ -n "$enabled" ] && [ -n "$first" ]; then
            host_result "recovery-$n" PASS "$detail"
        else
            host_result "recovery-$n" FAIL "$detail"
        fi
    done
    restarts=$(grep -c 'restarting it' "$TMP/udrive.log" || true)
    if [ "$KILLS" = "$CRASHES" ] && [ "$restarts" = "$KILLS" ]; then
        host_result supervisor-restarts PASS "$restarts restarts for $KILLS kills: $(grep 'restarting it' "$TMP/udrive.log" | tail -n1 | cut -c1-160)"
    else
        host_result supervisor-restarts FAIL "$KILLS kills (want $CRASHES), $restarts restarts in udrive's log"
    fi
fi
if [ "$UPGRADE" = 1 ]; then
    for n in $(seq "$UPGRADES"); do
        if [ ! -f "$TMP/upgrade-$n" ]; then
            host_result "pause-$n" FAIL "no upgrade $n: the guest did not ask"
            continue
        fi
        read -r _ secs old new <"$TMP/upgrade-$n"
        if [ "$new" = none ] || [ "$new" = "$old" ]; then
            host_result "pause-$n" FAIL "no pause to measure: upgrade $n failed (pid $old serves on; see upgrade-$n)"
            continue
        fi
        first='' ops='' before=''
        [ ! -f "$TMP/first-io-$n" ] || read -r first ops before <"$TMP/first-io-$n"
        # The n-th handover as the new process logged it (old -> new).
        took=$(sed 's/\x1b\[[0-9;]*m//g' "$TMP/udrive.log" | grep 'took every device over' | sed -n "${n}p" |
            grep -oE 'total_us=[0-9]+' | cut -d= -f2 || true)
        [ -z "$took" ] || took="$(awk -v u="$took" 'BEGIN { printf "%.1f", u / 1000 }') ms"
        detail="pid $old -> $new: udrive upgrade ${secs} s (the new process logged its takeover: ${took:-nothing}), -> first I/O completion by the new process ${first:+between $before and }${first:-never} s${ops:+ (get_stats: $ops ops)}"
        if [ -n "$first" ]; then host_result "pause-$n" PASS "$detail"; else host_result "pause-$n" FAIL "$detail"; fi
    done
    if [ "$UPGRADES_DONE" != "$UPGRADES" ]; then
        host_result upgrades-asked FAIL "the guest asked for $UPGRADES_DONE upgrades, want $UPGRADES"
    fi
fi
n=$(grep -ci 'doorbell buffer configured' "$TMP/udrive.log" || true)
# Configured is not enough: the exit statistics must show doorbells read from the shadow buffer.
stat() { sed 's/\x1b\[[0-9;]*m//g' "$TMP/udrive.log" | grep -o "$1=[0-9]*" | tail -n1 | cut -d= -f2; }
reads=$(stat shadow_doorbell_reads)
dma_r=$(stat dma_read_messages) dma_w=$(stat dma_write_messages) dma_t=$(stat dma_message_timeouts)
if [ "$MEM" = private ]; then
    # A shadow buffer in unshared memory would be fetched on every poll: udrive
    # refuses it and the guest rings its doorbells.
    if [ "$n" = 0 ] && [ "${reads:-0}" = 0 ]; then
        host_result shadow-doorbells PASS "refused in unshared memory, as meant (the guest rings doorbells)"
    else
        host_result shadow-doorbells FAIL "configured $n time(s), shadow_doorbell_reads=${reads:-none} with unshared guest RAM"
    fi
    if [ "${dma_r:-0}" -gt 0 ] && [ "${dma_w:-0}" -gt 0 ] && [ "${dma_t:-1}" = 0 ]; then
        host_result dma-messages PASS "guest RAM not shared: $dma_r DMA_READ and $dma_w DMA_WRITE messages, no timeouts"
    else
        host_result dma-messages FAIL "DMA_READ ${dma_r:-none}, DMA_WRITE ${dma_w:-none}, timeouts ${dma_t:-none}"
    fi
else
    if [ "$n" -gt 0 ] && [ "${reads:-0}" -gt 0 ]; then
        host_result shadow-doorbells PASS "configured $n time(s), shadow_doorbell_reads=$reads: $(grep -i 'doorbell' "$TMP/udrive.log" | tail -n 2 | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ' | cut -c1-240)"
    else
        host_result shadow-doorbells FAIL "udrive logged 'doorbell buffer configured' $n time(s), shadow_doorbell_reads=${reads:-none}"
    fi
    # Shared RAM is the fast path: no byte moves by message (QEMU's ROMs, which it
    # maps without a file descriptor even so, are never touched by the device).
    if [ "${dma_r:-0}" = 0 ] && [ "${dma_w:-0}" = 0 ]; then
        host_result dma-messages PASS "guest RAM shared: no DMA_READ/DMA_WRITE messages"
    else
        host_result dma-messages FAIL "guest RAM shared, yet ${dma_r:-?} DMA_READ and ${dma_w:-?} DMA_WRITE messages"
    fi
fi
# An idle guest: a sleeping reactor uses next to no CPU, a busy one a whole core.
if [ "$DEVICE" = udrive ] && [ "$IDLE_SECS" -gt 0 ]; then
    if [ -z "$IDLE_RESULT" ]; then
        host_result idle-cpu FAIL "no idle span measured (guest markers UDRIVE-IDLE missing)"
    else
        read -r pct secs <<<"$IDLE_RESULT"
        detail="poll $POLL: udrive used $pct% of a core while the guest idled ${secs}s"
        if [ "$POLL" = busy ] || awk -v p="$pct" 'BEGIN { exit !(p < 50) }'; then
            host_result idle-cpu PASS "$detail"
        else
            host_result idle-cpu FAIL "$detail (a sleeping reactor should be near 0%)"
        fi
    fi
fi
errors=$(grep -E 'panicked| ERROR ' "$TMP/udrive.log" | head -n 2 | tr '\n' ' ' | cut -c1-240 || true)
warns=$(grep -c ' WARN ' "$TMP/udrive.log" || true)
if [ -n "${LAST_PID:-}" ] && [ "$UDRIVE_RC" = 0 ] && [ -z "$errors" ]; then
    host_result udrive-clean-exit PASS "the first udrive exited ${FIRST_RC:-?} after its handover, the last (pid $LAST_PID, not our child) within 10 s of SIGTERM; no panics or ERROR lines, $warns WARN lines"
elif [ "$UDRIVE_RC" = 0 ] && [ -z "$errors" ]; then
    host_result udrive-clean-exit PASS "udrive exited 0 on SIGTERM; no panics or ERROR lines, $warns WARN lines"
else
    host_result udrive-clean-exit FAIL "udrive exit status $UDRIVE_RC; $errors"
fi

report "$TMP/console.log" "$TMP/udrive.log" "$TMP/qemu.log"
