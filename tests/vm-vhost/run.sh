#!/usr/bin/env bash
# udrive vhost-user-blk VM test: Debian 12's QEMU 7.2 boots Debian's cloud kernel
# under TCG with a vhost-user-blk-pci disk served by `udrive serve --vhost-user-blk`
# (or qemu-storage-daemon, to check the harness), and checks what the guest's stock
# virtio_blk driver does, the backing file, a warm reboot and (optionally) a
# backend restart under a running guest.
# Entry point: scripts/vm-test-vhost. Settings are listed in tests/vm-vhost/README.md.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/vm-vhost

CACHE=${UDRIVE_VM_CACHE:-/var/cache/udrive-vm}
# Debian 12's own QEMU (7.2) and qemu-storage-daemon, in a chroot: see README.md
# for why not on the host.
BOOKWORM=$CACHE/bookworm
BOOKWORM_PKGS=qemu-system-x86,busybox-static
BACKEND=${UDRIVE_VHOST_BACKEND:-udrive} # udrive | qsd
QUEUES=${UDRIVE_VHOST_QUEUES:-2}
VCPUS=${UDRIVE_VM_VCPUS:-$QUEUES}
# 1: the live-handover scenario instead of the checks below: one boot of
# tests/vm/guest-upgrade.sh (fio with verify) that asks UPGRADES times for
# `udrive upgrade`; QEMU must not reconnect and the guest must see no error.
UPGRADE=${UDRIVE_VM_VHOST_UPGRADE:-0}
UPGRADES=${UDRIVE_VM_UPGRADES:-3}
UPGRADE_JOB_MIB=${UDRIVE_VM_UPGRADE_JOB_MIB:-384} # fio MiB per vCPU
if [ "$UPGRADE" = 1 ]; then
    DISK_MIB=${UDRIVE_VHOST_DISK_MIB:-1024}
else
    DISK_MIB=${UDRIVE_VHOST_DISK_MIB:-256}
fi
RECONNECT=${UDRIVE_VHOST_RECONNECT:-1}
WRITERS=${UDRIVE_VHOST_WRITERS:-4}        # concurrent guest writers (requests in flight) during the reconnect
KILL_AFTER=${UDRIVE_VHOST_KILL_AFTER:-16}  # acknowledged chunks before the SIGKILL
DOWN_SECS=${UDRIVE_VHOST_DOWN_SECS:-1}     # backend down time
# KILL: a crash (the guest's requests in flight stay in the inflight log); TERM: a
# stop (udrive finishes what is in flight first), as `systemctl restart` does.
RECON_SIGNAL=${UDRIVE_VHOST_RECON_SIGNAL:-KILL}
STALL_SECS=${UDRIVE_VHOST_STALL_SECS:-60}  # no guest progress after the restart = failure
TIMEOUT=${UDRIVE_VM_TIMEOUT:-240}
UDRIVE_ARGS=${UDRIVE_VHOST_ARGS:-} # more `udrive serve` options, e.g. "--placement single"
# Online resize (udrive only: qemu-storage-daemon has no control socket here).
RESIZE=0
[ "$BACKEND" != udrive ] || RESIZE=${UDRIVE_VHOST_RESIZE:-1}
DATA_MIB=8
MIB=1048576
A_OFF=0 B_OFF=$((16 * MIB)) # as in guest-init.sh

TAG=vm-test-vhost
# shellcheck source=tests/vm/lib.sh
source "$root/tests/vm/lib.sh"

case $BACKEND in udrive | qsd) ;; *) die "UDRIVE_VHOST_BACKEND must be udrive or qsd, not '$BACKEND'" ;; esac
[ "$UPGRADE" != 1 ] || [ "$BACKEND" = udrive ] || die "UDRIVE_VM_VHOST_UPGRADE=1 needs UDRIVE_VHOST_BACKEND=udrive"
vm_begin "$BOOKWORM"

# ------------------------------------------------------------ setup
ensure_bookworm() {
    ensure_chroot "$BOOKWORM" bookworm "$BOOKWORM_PKGS"
    check_qemu "$BOOKWORM" vhost-user-blk-pci
}

build_initramfs() {
    local r=$TMP/initramfs
    initramfs_begin "$r" "$BOOKWORM/bin/busybox"
    mkdir -p "$r/lib/modules" "$r/data"
    cp "$TMP"/modules/*.ko "$r/lib/modules/"
    if [ "$UPGRADE" = 1 ]; then
        # fio from the NVMe test's sid chroot (bookworm's has none).
        [ -x "$CACHE/sid/usr/bin/fio" ] ||
            die "no fio in $CACHE/sid: run scripts/vm-test once first (its sid chroot has fio)"
        initramfs_add_bin "$r" "$CACHE/sid" /usr/bin/fio
        initramfs_pack "$r" "$root/tests/vm/guest-upgrade.sh" "$TMP/initramfs.cpio"
        say "initramfs: $(du -m "$TMP/initramfs.cpio" | cut -f1) MiB (busybox, virtio modules, fio + libraries)"
        return 0
    fi
    # The known data: random, made here, compared here with the backing file.
    head -c $((DATA_MIB * MIB)) /dev/urandom >"$TMP/a.bin"
    head -c $((DATA_MIB * MIB)) /dev/urandom >"$TMP/b.bin"
    cp "$TMP/a.bin" "$TMP/b.bin" "$r/data/"
    initramfs_pack "$r" "$here/guest-init.sh" "$TMP/initramfs.cpio"
    say "initramfs: $(du -m "$TMP/initramfs.cpio" | cut -f1) MiB (busybox, virtio modules, 2 x $DATA_MIB MiB data)"
}

# ------------------------------------------------------------ backend
# start_backend: udrive or qemu-storage-daemon on $TMP/vblk.sock over $TMP/disk.img;
# logs append to $TMP/backend.log (one process after another on restarts).
start_backend() {
    rm -f "$TMP/vblk.sock"
    echo "---- $(date +%T.%N) start" >>"$TMP/backend.log"
    if [ "$BACKEND" = udrive ]; then
        # shellcheck disable=SC2086 # UDRIVE_ARGS is a list of options
        set -- "$UDRIVE" serve --vhost-user-blk "$TMP/vblk.sock" --disk "file:$TMP/disk.img" --queues "$QUEUES" \
            --rpc "$TMP/rpc.sock" $UDRIVE_ARGS
        echo "$*" >>"$TMP/backend.log"
        NO_COLOR=1 RUST_LOG=${RUST_LOG:-info} setpriv --pdeathsig KILL -- "$@" >>"$TMP/backend.log" 2>&1 </dev/null &
    else
        set -- qemu-storage-daemon \
            --blockdev "driver=file,node-name=disk0,filename=$IN_CHROOT/disk.img,cache.direct=on,aio=io_uring,discard=unmap" \
            --export "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=$IN_CHROOT/vblk.sock,writable=on,num-queues=$QUEUES"
        echo "chroot $BOOKWORM $*" >>"$TMP/backend.log"
        in_chroot "$BOOKWORM" "$@" >>"$TMP/backend.log" 2>&1 </dev/null &
    fi
    SERVER_PID=$!
    wait_socket "$TMP/vblk.sock" "$SERVER_PID" "$TMP/backend.log" "$BACKEND"
}

stop_backend() {
    if [ "$UPGRADE" = 1 ] && [ -n "$SERVER_PID" ] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
        # The first process exited after its handover; the one serving now is not
        # our child (stop_upgraded).
        wait "$SERVER_PID" 2>/dev/null && FIRST_RC=0 || FIRST_RC=$?
        SERVER_PID=
        stop_upgraded "$TMP/rpc.sock"
        BACKEND_RC=$STOP_RC
        LAST_PID=$STOP_PID
        return 0
    fi
    stop_pid "$SERVER_PID"
    BACKEND_RC=$STOP_RC
    SERVER_PID=
}

# ------------------------------------------------------------ QEMU 7.2
start_qemu() {
    local mem=512M d=$IN_CHROOT RECONNECT_OPT=''
    [ "$RECONNECT" != 1 ] || RECONNECT_OPT=,reconnect=1
    : >"$TMP/console.log"
    mkfifo "$TMP/ctl.in" "$TMP/ctl.out" # ttyS1: host -> guest messages
    # shellcheck disable=SC2054 # commas belong to QEMU options
    QEMU_ARGS=(
        -accel tcg -cpu "$TCG_CPU" -smp "$VCPUS" -m "$mem"
        -object "memory-backend-memfd,id=mem,size=$mem,share=on" -numa node,memdev=mem
        -bios /usr/share/qemu/qboot.rom -nic none -nographic -monitor none
        -serial "file:$d/console.log" -chardev "pipe,id=ctl,path=$d/ctl" -serial chardev:ctl
        -kernel "$d/vmlinuz" -initrd "$d/initramfs.cpio"
        -append "console=ttyS0 quiet edd=off panic=-1 rdinit=/init udrive.queues=$QUEUES udrive.size=$((DISK_MIB * MIB)) udrive.reconnect=$RECONNECT udrive.writers=$WRITERS udrive.resize=$RESIZE${UPGRADE_ARGS:-}"
        -chardev "socket,id=c0,path=$d/vblk.sock${RECONNECT_OPT}"
        -device "vhost-user-blk-pci,chardev=c0,num-queues=$QUEUES"
    )
    echo "chroot $BOOKWORM qemu-system-x86_64 ${QEMU_ARGS[*]}" >"$TMP/qemu.cmd"
    in_chroot "$BOOKWORM" qemu-system-x86_64 "${QEMU_ARGS[@]}" >"$TMP/qemu.log" 2>&1 </dev/null &
    QEMU_PID=$!
}

# ------------------------------------------------------------ host-side checks during the run
# The guest flushed its data and waits: the backing file must hold the same bytes.
host_check_file() {
    local bad=''
    cmp -n $((DATA_MIB * MIB)) "$TMP/disk.img" "$TMP/a.bin" "$A_OFF" 0 >/dev/null 2>&1 || bad="$bad a.bin"
    cmp -n $((DATA_MIB * MIB)) "$TMP/disk.img" "$TMP/b.bin" "$B_OFF" 0 >/dev/null 2>&1 || bad="$bad b.bin"
    if [ -z "$bad" ]; then
        host_result backing-file-matches PASS "disk.img holds a.bin at $((A_OFF / MIB)) MiB and b.bin at $((B_OFF / MIB)) MiB, byte for byte, while the guest runs"
        tell_guest "go: backing file matches"
    else
        host_result backing-file-matches FAIL "disk.img differs from$bad"
        tell_guest "go: backing file DIFFERS ($bad)"
    fi
}

# The guest asks for a resize: the resize RPC; its answer is a host result, and the
# guest hears "resized" (or "failed") on ttyS1, then checks that its disk follows.
RESIZES=0
host_resize() {
    local re='^UDRIVE-RESIZE bytes=([0-9]+) shrink=([01])' shrink=false out
    [[ $1 =~ $re ]] || return 0
    local bytes=${BASH_REMATCH[1]}
    [ "${BASH_REMATCH[2]}" = 0 ] || shrink=true
    RESIZES=$((RESIZES + 1))
    local params="{\"socket\":\"$TMP/vblk.sock\",\"size\":$bytes,\"shrink\":$shrink}"
    if out=$("$UDRIVE" rpc --rpc "$TMP/rpc.sock" resize "$params" 2>&1) && grep -q '"notified": true' <<<"$out"; then
        host_result "resize-rpc-$RESIZES" PASS "disk to $((bytes / MIB)) MiB (shrink $shrink), disk.img $(($(stat -c %s "$TMP/disk.img") / MIB)) MiB, front end notified: $(grep -o '"notice": "[^"]*"' <<<"$out" | cut -c1-120)"
        tell_guest "resized: $((bytes / MIB)) MiB"
    else
        host_result "resize-rpc-$RESIZES" FAIL "disk to $bytes bytes (shrink $shrink): $(tr '\n' ' ' <<<"$out" | cut -c1-240)"
        tell_guest "failed: $(tr '\n' ' ' <<<"$out" | cut -c1-120)"
    fi
}

# Reconnect: SIGKILL the backend after KILL_AFTER acknowledged chunks, restart it on
# the same socket and file, tell the guest; then watch that the guest's I/O resumes.
RECON_STATE=off RECON_ACKS=0 KILL_T='' RESUME_T='' ACKS_AT_KILL=0 LAST_PROGRESS_T=''
kill_and_restart() {
    say "reconnect: SIG$RECON_SIGNAL $BACKEND (pid $SERVER_PID) after $RECON_ACKS acknowledged chunks"
    KILL_T=$EPOCHREALTIME ACKS_AT_KILL=$RECON_ACKS
    kill "-$RECON_SIGNAL" "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
    echo "---- $(date +%T.%N) stopped with SIG$RECON_SIGNAL" >>"$TMP/backend.log"
    sleep "$DOWN_SECS"
    start_backend
    say "reconnect: $BACKEND restarted (pid $SERVER_PID) $(elapsed "$KILL_T") s after the kill"
    RECON_STATE=restarted LAST_PROGRESS_T=$EPOCHREALTIME
    tell_guest "restarted: $BACKEND killed after $ACKS_AT_KILL chunks, back after $(elapsed "$KILL_T") s"
}
# On UDRIVE-UPGRADE (UDRIVE_VM_VHOST_UPGRADE=1): udrive upgrade (host result
# upgrade-N) and the answer on ttyS1.
UPGRADES_DONE=0
upgrade_hook() {
    local re='^UDRIVE-UPGRADE n=([0-9]+)'
    [[ $1 =~ $re ]] || return 0
    UPGRADES_DONE=$((UPGRADES_DONE + 1))
    udrive_upgrade "$UPGRADES_DONE" "$TMP/rpc.sock" "$TMP/backend.log"
    if [ "$UPG_OK" = 1 ]; then
        tell_guest "upgraded n=$UPGRADES_DONE: pid $UPG_OLD -> $UPG_NEW in $UPG_SECS s"
    else
        tell_guest "failed n=$UPGRADES_DONE: $(cut -c1-200 <<<"$UPG_WHY")"
    fi
}
# After the upgrade run: QEMU kept its one connection (udrive logs each front end
# that connects — a taken-over connection must not pass through accept(); QEMU,
# with reconnect=1, logs a lost backend).
check_no_reconnect() {
    local conns qlines
    conns=$(grep -c 'vhost-user front end connected' "$TMP/backend.log" || true)
    qlines=$(grep -aiE 'disconnect|reconnect|ring restore failed|Failed to (read|write|set)|vhost.*(fail|error)|Connection reset' "$TMP/qemu.log" |
        head -n 3 | tr '\n' ' ' | cut -c1-240 || true)
    if [ "$conns" = 1 ] && [ -z "$qlines" ]; then
        host_result no-reconnect PASS "one vhost-user connection across $UPGRADES_DONE upgrade requests (udrive's logs); nothing about a lost backend in QEMU's log"
    else
        host_result no-reconnect FAIL "$conns vhost-user connections in udrive's logs (want 1); QEMU: ${qlines:-nothing}"
    fi
    [ "$UPGRADES_DONE" = "$UPGRADES" ] ||
        host_result upgrades-asked FAIL "the guest asked for $UPGRADES_DONE upgrades, want $UPGRADES"
}
on_guest() {
    if [ $# = 0 ]; then
        if [ "$RECON_STATE" = restarted ] && [ -z "$RESUME_T" ] &&
            [ "$(elapsed "$LAST_PROGRESS_T" | cut -d. -f1)" -ge "$STALL_SECS" ]; then
            say "reconnect: no acknowledged write for $STALL_SECS s after the restart; killing QEMU"
            HARNESS_FAIL+=("reconnect-stalled")
            RECON_STATE=stalled
            kill -KILL "$QEMU_PID" 2>/dev/null || true
        fi
        return 0
    fi
    case "$1" in
    UDRIVE-UPGRADE*) upgrade_hook "$1" ;;
    UDRIVE-HOSTCHECK*) host_check_file ;;
    UDRIVE-RESIZE*) host_resize "$1" ;;
    UDRIVE-RECONNECT-READY*) RECON_STATE=armed ;;
    UDRIVE-ACK*)
        RECON_ACKS=$((RECON_ACKS + 1))
        if [ "$RECON_STATE" = armed ] && [ "$RECON_ACKS" -ge "$KILL_AFTER" ]; then
            kill_and_restart
        elif [ "$RECON_STATE" = restarted ] && [ -z "$RESUME_T" ]; then
            RESUME_T=$EPOCHREALTIME
            say "reconnect: guest I/O resumed $(awk -v a="$KILL_T" -v b="$RESUME_T" 'BEGIN { printf "%.1f", b - a }') s after the kill"
        fi
        ;;
    UDRIVE-NACK*) say "reconnect: the guest saw a write error: $1" ;;
    UDRIVE-RECONNECT-END*) [ "$RECON_STATE" != restarted ] || RECON_STATE=finished ;;
    esac
    return 0
}

# After the run: every chunk the guest saw acknowledged is in the backing file.
check_acked_chunks() {
    local n=0 bad=0 seq off sha got re='seq=([0-9]+) off=([0-9]+) sha=([0-9a-f]+)'
    while IFS= read -r l; do
        [[ $l =~ $re ]] || continue
        seq=${BASH_REMATCH[1]} off=${BASH_REMATCH[2]} sha=${BASH_REMATCH[3]}
        got=$(dd if="$TMP/disk.img" bs=65536 skip=$((off / 65536)) count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
        n=$((n + 1))
        [ "$got" = "$sha" ] || { bad=$((bad + 1)); say "chunk $seq at $off: guest wrote $sha, file has $got"; }
    done < <(grep -a '^UDRIVE-ACK ' "$TMP/console.log" | tr -d '\r')
    if [ "$n" -gt "$KILL_AFTER" ] && [ "$bad" = 0 ]; then
        host_result reconnect-acked-in-file PASS "all $n acknowledged chunks are in disk.img ($ACKS_AT_KILL before the SIGKILL)"
    elif [ "$bad" = 0 ]; then
        host_result reconnect-acked-in-file FAIL "only $n chunks acknowledged, none after the restart (those $n are intact in disk.img)"
    else
        host_result reconnect-acked-in-file FAIL "$bad of $n acknowledged chunks differ in disk.img"
    fi
    if [ -n "$RESUME_T" ]; then
        host_result reconnect-resumed PASS "guest I/O resumed $(awk -v a="$KILL_T" -v b="$RESUME_T" 'BEGIN { printf "%.1f", b - a }') s after the SIGKILL ($DOWN_SECS s down)"
    else
        host_result reconnect-resumed FAIL "state $RECON_STATE: guest I/O did not resume after the restart${KILL_T:+ (killed after $ACKS_AT_KILL chunks)}"
    fi
}

# ------------------------------------------------------------ main
phase "setup: bookworm chroot with QEMU 7.2"
ensure_bookworm
phase "setup: guest kernel"
ensure_kernel
phase "setup: initramfs"
build_initramfs
if [ "$BACKEND" = udrive ]; then
    phase "setup: build udrive"
    build_udrive
    "$UDRIVE" serve --help 2>/dev/null | grep -q -- '--vhost-user-blk' ||
        die "$UDRIVE serve has no --vhost-user-blk option (this udrive has no virtio-blk device); UDRIVE_VHOST_BACKEND=qsd runs the guest against qemu-storage-daemon"
fi
if [ "$UPGRADE" = 1 ]; then
    phase "guest run (live handover: $UPGRADES x udrive upgrade under fio)"
    UPGRADE_ARGS=" udrive.dev=vda udrive.upgrades=$UPGRADES udrive.job_mib=$UPGRADE_JOB_MIB"
    LAST_PHASE=1
else
    phase "guest run"
    LAST_PHASE=2
fi
truncate -s "${DISK_MIB}M" "$TMP/disk.img"
start_backend
say "backend: $(sed -n 2p "$TMP/backend.log")"
start_qemu
watch_guest "$TMP/console.log" "$TIMEOUT" on_guest '^UDRIVE-ACK '
stop_backend
phase ""

guest_results "$TMP/console.log"
if grep -aq "^UDRIVE-DONE phase=$LAST_PHASE" "$TMP/console.log" && [ "$QEMU_RC" = 0 ]; then
    host_result guest-completed PASS "$([ "$LAST_PHASE" = 2 ] && echo both boots || echo the boot) finished, QEMU exited 0"
else
    host_result guest-completed FAIL "QEMU exit $QEMU_RC; last marker: $(grep -aE '^UDRIVE-(BOOT|DONE)' "$TMP/console.log" | tail -n1) ${HARNESS_FAIL[*]}"
fi
if [ "$UPGRADE" = 1 ]; then
    check_no_reconnect
else
    grep -q '^UDRIVE-RESULT name=backing-file-matches' < <(printf '%s\n' "${RESULTS[@]}") ||
        host_result backing-file-matches FAIL "the guest never asked for the check"
    [ "$RECONNECT" != 1 ] || check_acked_chunks
fi
errors=$(grep -E 'panicked| ERROR ' "$TMP/backend.log" | head -n 2 | tr '\n' ' ' | cut -c1-240 || true)
# qemu-storage-daemon dies of SIGTERM (143); udrive must exit 0.
if [ -n "${LAST_PID:-}" ] && [ "$BACKEND_RC" = 0 ] && [ -z "$errors" ]; then
    host_result backend-clean-exit PASS "the first udrive exited ${FIRST_RC:-?} after its handover, the last (pid $LAST_PID, not our child) within 10 s of SIGTERM; no panics or ERROR lines, $(grep -c ' WARN ' "$TMP/backend.log" || true) WARN lines"
elif { [ "$BACKEND_RC" = 0 ] || { [ "$BACKEND" = qsd ] && [ "$BACKEND_RC" = 143 ]; }; } && [ -z "$errors" ]; then
    host_result backend-clean-exit PASS "$BACKEND exited $BACKEND_RC on SIGTERM; no panics or ERROR lines, $(grep -c ' WARN ' "$TMP/backend.log" || true) WARN lines"
else
    host_result backend-clean-exit FAIL "$BACKEND exit status $BACKEND_RC; $errors"
fi
report "$TMP/console.log" "$TMP/backend.log" "$TMP/qemu.log"
