#!/usr/bin/env bash
# udrive live-migration VM test: a Linux guest on Debian 12's QEMU 7.2 (TCG) with a
# vhost-user-blk-pci disk served by udrive is migrated to a second QEMU whose disk a
# second udrive process serves from the same file, and back, while the guest runs
# migcheck (a write / read-into-RAM / check loop). The guest must see no mismatch,
# during the passes or in its final full check, and the backing file must hold its
# last generation (UDRIVE_MIGRATE_BACKEND=rbd: the same with an RBD image on a
# throwaway Ceph cluster, served by both processes). Entry point: scripts/vm-test-migrate; see tests/vm-migrate/README.md.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/vm-migrate

CACHE=${UDRIVE_VM_CACHE:-/var/cache/udrive-vm}
BOOKWORM=$CACHE/bookworm
BOOKWORM_PKGS=qemu-system-x86,busybox-static
DISK_MIB=${UDRIVE_MIGRATE_DISK_MIB:-64}
CHECK_MIB=${UDRIVE_MIGRATE_CHECK_MIB:-32} # migcheck's region (and its RAM buffer)
# Not 512M: QEMU 7.2 under TCG corrupts a 512 MiB guest by itself while migrating
# (fixed in QEMU 9.0); any other size avoids its bad path.
MEM=${UDRIVE_MIGRATE_MEM:-524296K}
SLOW_BW=${UDRIVE_MIGRATE_SLOW_BW:-$((24 << 20))} # bytes/s while the dirty passes run
FAST_BW=${UDRIVE_MIGRATE_FAST_BW:-$((1 << 30))} # then, to converge
DIRTY_SYNCS=${UDRIVE_MIGRATE_DIRTY_SYNCS:-3}  # dirty-log syncs at SLOW_BW before FAST_BW
PASSES=${UDRIVE_MIGRATE_PASSES:-2}            # migcheck passes on each QEMU before moving on
TIMEOUT=${UDRIVE_VM_TIMEOUT:-240}
# 1: the udrive processes do not mark read data in the dirty log (a test knob of
# vhost-user-blk): the run must then report mismatches.
SKIP_DIRTY=${UDRIVE_MIGRATE_SKIP_DIRTY_DATA:-0}
# The disk options of both devices: `shared` (the default) lets both open the file
# as writers; empty has the devices hand the file's writer claim (a lock on its
# range) over at the switch-over.
DISK_OPTS=${UDRIVE_MIGRATE_DISK_OPTS-,shared}
# file: a file in TMP; rbd: image rbd/mig on a throwaway cluster (scripts/ceph-cluster),
# whose exclusive lock is the writer claim; qcow2: an empty qcow2 image in TMP, whose
# claim carries its metadata over (flushed by the source, reloaded by the
# destination). rbd and qcow2 have one writer: DISK_OPTS is ignored.
BACKEND=${UDRIVE_MIGRATE_BACKEND:-file}
# shared: both processes serve the same disk. nbd (qcow2 only): B serves an image
# of its own, which A's disk is mirrored into over B's NBD export before the
# migration (migration without shared storage); one hop, A -> B.
STORAGE=${UDRIVE_MIGRATE_STORAGE:-shared}
# qsd: the same run with qemu-storage-daemon's vhost-user-blk export (the host's,
# from Debian's backports) serving the file in both places, for comparison
# (docs/benchmarks.md). Its exports share the file with image locking off.
SERVER=${UDRIVE_MIGRATE_SERVER:-udrive}
QMP=$here/qmp.py

TAG=vm-test-migrate
# shellcheck source=tests/vm/lib.sh
source "$root/tests/vm/lib.sh"
vm_begin "$BOOKWORM"

build_initramfs() {
    local r=$TMP/initramfs
    initramfs_begin "$r" "$BOOKWORM/bin/busybox"
    mkdir -p "$r/lib/modules"
    cp "$TMP"/modules/*.ko "$r/lib/modules/"
    gcc -O2 -static -Wall -o "$r/bin/migcheck" "$here/migcheck.c" || die "cannot build migcheck (gcc, static libc)"
    cp "$r/bin/migcheck" "$TMP/migcheck-host"
    initramfs_pack "$r" "$here/guest-init.sh" "$TMP/initramfs.cpio"
}

# start_udrive NAME SPEC: `udrive serve` with one vhost-user-blk device on
# $TMP/NAME.sock for disk SPEC; its log is $TMP/udrive-NAME.log.
start_udrive() {
    local name=$1 spec=$2 pid
    if [ "$SERVER" = qsd ]; then
        start_qsd "$name"
        return
    fi
    local env=(NO_COLOR=1 "RUST_LOG=${RUST_LOG:-info}")
    [ "$SKIP_DIRTY" != 1 ] || env+=(UDRIVE_TEST_SKIP_DIRTY_DATA=1)
    set -- "$UDRIVE" serve --vhost-user-blk "$TMP/$name.sock" --disk "$spec" --queues 1 --rpc "$TMP/rpc-$name.sock" \
        --poll "${UDRIVE_MIGRATE_POLL:-adaptive}"
    echo "$*" >"$TMP/udrive-$name.log"
    env "${env[@]}" setpriv --pdeathsig KILL -- "$@" >>"$TMP/udrive-$name.log" 2>&1 </dev/null &
    pid=$!
    VM_EXTRA_PIDS+=("$pid")
    wait_socket "$TMP/$name.sock" "$pid" "$TMP/udrive-$name.log" "udrive ($name)"
    UDRIVE_PIDS[$name]=$pid
}

# start_qsd NAME: qemu-storage-daemon exporting $TMP/disk.img on $TMP/NAME.sock.
start_qsd() {
    local name=$1 pid
    set -- qemu-storage-daemon \
        --blockdev "driver=file,node-name=file0,filename=$TMP/disk.img,locking=off" \
        --export "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path=$TMP/$name.sock,writable=on,num-queues=1"
    echo "$*" >"$TMP/udrive-$name.log"
    setpriv --pdeathsig KILL -- "$@" >>"$TMP/udrive-$name.log" 2>&1 </dev/null &
    pid=$!
    VM_EXTRA_PIDS+=("$pid")
    wait_socket "$TMP/$name.sock" "$pid" "$TMP/udrive-$name.log" "qemu-storage-daemon ($name)"
    UDRIVE_PIDS[$name]=$pid
}

# start_qemu N SOCKET [incoming]: QEMU number N on the device at $TMP/SOCKET.sock,
# console $TMP/console-N.log, ttyS1 $TMP/ctl-N, QMP $TMP/qmp-N.sock; "incoming"
# waits for a migration on $TMP/mig-N.sock.
declare -A UDRIVE_PIDS QEMU_PIDS
start_qemu() {
    local n=$1 sock=$2 d=$IN_CHROOT args
    : >"$TMP/console-$n.log"
    mkfifo "$TMP/ctl-$n.in" "$TMP/ctl-$n.out"
    # shellcheck disable=SC2054 # commas belong to QEMU options
    args=(
        -accel tcg -cpu "$TCG_CPU" -smp 1 -m "$MEM"
        -object "memory-backend-memfd,id=mem,size=$MEM,share=on" -numa node,memdev=mem
        -bios /usr/share/qemu/qboot.rom -nic none -nographic -monitor none
        -qmp "unix:$d/qmp-$n.sock,server=on,wait=off"
        -serial "file:$d/console-$n.log" -chardev "pipe,id=ctl,path=$d/ctl-$n" -serial chardev:ctl
        -kernel "$d/vmlinuz" -initrd "$d/initramfs.cpio"
        -append "console=ttyS0 quiet edd=off panic=-1 rdinit=/init udrive.mib=$CHECK_MIB"
        -chardev "socket,id=c0,path=$d/$sock.sock"
        -device "vhost-user-blk-pci,id=vblk0,chardev=c0,num-queues=1"
    )
    [ "${3:-}" != incoming ] || args+=(-incoming "unix:$d/mig-$n.sock")
    echo "chroot $BOOKWORM qemu-system-x86_64 ${args[*]}" >"$TMP/qemu-$n.cmd"
    in_chroot "$BOOKWORM" qemu-system-x86_64 "${args[@]}" >"$TMP/qemu-$n.log" 2>&1 </dev/null &
    QEMU_PIDS[$n]=$!
    VM_EXTRA_PIDS+=("$!")
    wait_socket "$TMP/qmp-$n.sock" "${QEMU_PIDS[$n]}" "$TMP/qemu-$n.log" "QEMU $n"
}

qmp() { # qmp N COMMAND [JSON]
    local n=$1
    shift
    python3 "$QMP" "$TMP/qmp-$n.sock" "$@"
}

# wait_passes N COUNT: waits for COUNT migcheck passes on QEMU N's console; false
# if QEMU exits, the guest fails or TIMEOUT passes.
wait_passes() {
    local n=$1 want=$2 t0=$EPOCHREALTIME got
    while :; do
        got=$(grep -ac '^MIGCHECK pass=' "$TMP/console-$n.log" || true)
        [ "$got" -ge "$want" ] && return 0
        kill -0 "${QEMU_PIDS[$n]}" 2>/dev/null || return 1
        grep -aq '^UDRIVE-RESULT .*status=FAIL\|Kernel panic' "$TMP/console-$n.log" && return 1
        [ "$(elapsed "$t0" | cut -d. -f1)" -lt "$TIMEOUT" ] || return 1
        sleep 0.5
    done
}

json_num() { grep -oE "\"$1\": [0-9]+" | head -n1 | grep -oE '[0-9]+$' || true; }

# migrate FROM TO: live migration of QEMU FROM's guest to QEMU TO (started
# incoming): SLOW_BW until DIRTY_SYNCS dirty-log syncs, then FAST_BW until it
# completes. A host result migrate-FROM-TO with query-migrate's numbers; sets
# MIG_OK, MIG_TOTAL and MIG_DOWN (ms).
migrate() {
    local from=$1 to=$2 st status syncs fast=0 t0=$EPOCHREALTIME
    MIG_OK=0 MIG_TOTAL='' MIG_DOWN=''
    qmp "$from" migrate-set-parameters "{\"max-bandwidth\": $SLOW_BW}" >/dev/null
    qmp "$from" migrate "{\"uri\": \"unix:$IN_CHROOT/mig-$to.sock\"}" >/dev/null || {
        host_result "migrate-$from-$to" FAIL "QEMU $from refused to migrate: $(tail -n 3 "$TMP/qemu-$from.log" | tr '\n' ' ')"
        return 0
    }
    while :; do
        st=$(qmp "$from" query-migrate) || st='{}'
        status=$(grep -oE '"status": "[a-z-]+"' <<<"$st" | head -n1 | cut -d'"' -f4)
        syncs=$(json_num dirty-sync-count <<<"$st")
        if [ "$fast" = 0 ] && [ "${syncs:-0}" -ge "$DIRTY_SYNCS" ]; then
            qmp "$from" migrate-set-parameters "{\"max-bandwidth\": $FAST_BW}" >/dev/null
            fast=1
            say "migration $from -> $to: $syncs dirty-log syncs at $((SLOW_BW >> 20)) MiB/s; now $((FAST_BW >> 20)) MiB/s"
        fi
        case $status in
        completed) break ;;
        failed | cancelled | "") break ;;
        esac
        if [ "$(elapsed "$t0" | cut -d. -f1)" -ge "$TIMEOUT" ]; then
            qmp "$from" migrate_cancel >/dev/null || true
            status="not completed in $TIMEOUT s"
            break
        fi
        sleep 0.5
    done
    MIG_TOTAL=$(json_num total-time <<<"$st")
    MIG_DOWN=$(json_num downtime <<<"$st")
    local to_status
    to_status=$(qmp "$to" query-status | grep -oE '"status": "[a-z-]+"' | cut -d'"' -f4 || true)
    if [ "$status" = completed ] && [ "$to_status" = running ]; then
        MIG_OK=1
        host_result "migrate-$from-$to" PASS "completed: total ${MIG_TOTAL} ms, downtime ${MIG_DOWN} ms, ${syncs} dirty-log syncs; QEMU $to runs the guest"
    else
        host_result "migrate-$from-$to" FAIL "status ${status:-none}, QEMU $to ${to_status:-gone}: $(tr '\n' ' ' <<<"$st" | cut -c1-200) $(tail -n 2 "$TMP/qemu-$from.log" "$TMP/qemu-$to.log" | tr '\n' ' ')"
    fi
}

# hop FROM TO DEVICE: QEMU TO starts on udrive DEVICE's socket, incoming; the
# guest migrates there from QEMU FROM, which quits; then PASSES passes on QEMU TO.
# Nothing after a failure.
hop() {
    local from=$1 to=$2 dev=$3
    [ ${#HARNESS_FAIL[@]} = 0 ] || return 0
    start_qemu "$to" "$dev" incoming
    migrate "$from" "$to"
    quit_qemu "$from"
    [ "$MIG_OK" = 1 ] && wait_passes "$to" "$PASSES" || HARNESS_FAIL+=("no migcheck passes on QEMU $to")
}

quit_qemu() { # quit_qemu N: QMP quit (the source after its guest left), then wait
    local n=$1 pid=${QEMU_PIDS[$1]}
    qmp "$n" quit >/dev/null 2>&1 || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# start_ceph: a cluster in TMP (stopped by vm_cleanup) with an empty image rbd/mig
# of DISK_MIB; sets DISK_SPEC.
start_ceph() {
    ceph_start
    rbd --conf "$CEPH_CONF" create --size "${DISK_MIB}M" rbd/mig
    DISK_SPEC="rbd:rbd/mig,conf=$CEPH_CONF"
    say "ceph: $(tail -n 2 "$TMP/ceph.log" | head -n 1 | cut -c1-120); image rbd/mig, ${DISK_MIB} MiB"
}

# A block stream on A across the migrations: started slow (1 MiB/s over the
# base's pattern) so that it still runs at the switch-over; while the VM runs on
# B it must wait without copying (A does not write the image B writes); once the
# VM is back it finishes on A at full speed.
rpc_a() { "$UDRIVE" rpc --rpc "$TMP/rpc-a.sock" "$@" 2>&1; }
# (Both print nothing rather than fail: the callers judge what they got.)
job_field() { grep -oE "\"$1\": *\"?[a-z0-9]*" | head -n1 | grep -oE '[a-z0-9]*$' || true; }
stream_start() {
    local out
    if out=$(rpc_a block_stream "{\"socket\":\"$TMP/a.sock\",\"rate\":\"1M\"}") &&
        STREAM_ID=$(job_field job <<<"$out") && [ -n "$STREAM_ID" ]; then
        say "stream: job $STREAM_ID on A at 1 MiB/s"
    else
        host_result stream-across-migration FAIL "block_stream on A: $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
    fi
}
job_json() { rpc_a get_jobs | tr -d '\n' | grep -oE "\{[^{}]*\"id\": *$1,[^{}]*\}" || true; }
stream_job() { job_json "$STREAM_ID"; }
stream_waits() {
    [ -n "${STREAM_ID:-}" ] || return 0
    local j1 j2
    j1=$(stream_job) && sleep 1.5 && j2=$(stream_job)
    STREAM_AWAY="state $(job_field state <<<"$j2"), done $(job_field done <<<"$j1") -> $(job_field done <<<"$j2") bytes in 1.5 s"
    if [ "$(job_field state <<<"$j2")" != running ] || [ "$(job_field done <<<"$j1")" != "$(job_field done <<<"$j2")" ] ||
        ! grep -q 'block job waits' "$TMP/udrive-a.log"; then
        host_result stream-across-migration FAIL "while the VM ran on B, A's stream went on or ended: $STREAM_AWAY"
        STREAM_ID=
    fi
    # Nor does A start anything on the image B writes.
    local out
    out=$(rpc_a qcow2_snapshot_create "{\"socket\":\"$TMP/a.sock\",\"path\":\"$TMP/snap.qcow2\"}" || true)
    if grep -q 'runs in another process' <<<"$out" && [ ! -e "$TMP/snap.qcow2" ]; then
        host_result source-changes-nothing PASS "a snapshot on A while the VM runs on B is refused: $(grep -o 'the VM of .*' <<<"$out" | cut -c1-120)"
    else
        host_result source-changes-nothing FAIL "a snapshot on A while the VM runs on B: $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
    fi
}
stream_finishes() {
    [ -n "${STREAM_ID:-}" ] || return 0
    local out
    rpc_a job_set_rate "{\"id\":$STREAM_ID,\"rate\":0}" >/dev/null || true
    for _ in $(seq 120); do
        out=$(stream_job)
        [ "$(job_field state <<<"$out")" = running ] || break
        sleep 0.5
    done
    if [ "$(job_field state <<<"$out")" = completed ]; then
        STREAM_DONE=1
    else
        host_result stream-across-migration FAIL "after the VM came back to A: $out"
    fi
}
# Without shared storage: B exports its own image over NBD and A mirrors its
# running disk into it; `udrive rpc --wait` returns once the mirror is ready.
rpc_b() { "$UDRIVE" rpc --rpc "$TMP/rpc-b.sock" "$@" 2>&1; }
mirror_to_b() {
    local out uri="nbd+unix:///vm?socket=$TMP/nbd.sock"
    if ! out=$(rpc_b nbd_server_start "{\"listen\":\"unix:$TMP/nbd.sock\"}") ||
        ! out=$(rpc_b nbd_server_add "{\"socket\":\"$TMP/b.sock\",\"name\":\"vm\",\"writable\":true}"); then
        host_result mirror-to-destination FAIL "B's NBD export: $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
        HARNESS_FAIL+=("no NBD export on B")
        return 0
    fi
    if out=$(rpc_a --wait -t "$TIMEOUT" blockdev_mirror "{\"socket\":\"$TMP/a.sock\",\"target\":\"$uri\"}") &&
        MIRROR_ID=$(job_field job <<<"$out") && [ -n "$MIRROR_ID" ]; then
        say "mirror: job $MIRROR_ID ready: $(job_json "$MIRROR_ID" | cut -c1-160)"
    else
        host_result mirror-to-destination FAIL "blockdev_mirror on A: $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
        HARNESS_FAIL+=("no mirror into B")
    fi
}
# After the switch-over: A's mirror completes (the VM runs on B), B stops its
# NBD server.
mirror_complete() {
    [ -n "${MIRROR_ID:-}" ] || return 0
    local out before
    before=$(job_json "$MIRROR_ID")
    out=$(rpc_a job_complete "{\"id\":$MIRROR_ID}") || true
    for _ in $(seq 60); do
        out=$(job_json "$MIRROR_ID")
        [ "$(job_field state <<<"$out")" = ready ] || break
        sleep 0.5
    done
    rpc_b nbd_server_stop >/dev/null || true
    if [ "$(job_field state <<<"$before")" = ready ] && [ "$(job_field state <<<"$out")" = completed ]; then
        host_result mirror-to-destination PASS "ready through the migration, completed after it: $(cut -c1-160 <<<"$out")"
    else
        host_result mirror-to-destination FAIL "before job_complete: $before; after: $out"
    fi
}

# After the servers exited: the stream's result is in disk.qcow2 alone.
stream_check() {
    [ "${STREAM_DONE:-}" = 1 ] || return 0
    local info
    info=$(qemu-img info "$TMP/disk.qcow2" 2>&1)
    if grep -q 'backing file' <<<"$info"; then
        host_result stream-across-migration FAIL "disk.qcow2 still has a backing file: $(grep 'backing file' <<<"$info")"
    elif qemu-io -f qcow2 -c "read -q -P 0x5a ${CHECK_MIB}M $((DISK_MIB - CHECK_MIB))M" "$TMP/disk.qcow2" >"$TMP/stream-read.out" 2>&1 &&
        ! grep -q 'Pattern verification failed' "$TMP/stream-read.out"; then
        host_result stream-across-migration PASS "started on A, waited on A while the VM ran on B ($STREAM_AWAY), finished on A after the VM came back: disk.qcow2 stands alone and holds the base's pattern"
    else
        host_result stream-across-migration FAIL "disk.qcow2 does not hold the base's pattern past migcheck's region: $(head -c 200 "$TMP/stream-read.out")"
    fi
}

# ------------------------------------------------------------ main
phase "setup: bookworm chroot with QEMU 7.2"
ensure_chroot "$BOOKWORM" bookworm "$BOOKWORM_PKGS"
check_qemu "$BOOKWORM" vhost-user-blk-pci
phase "setup: guest kernel and initramfs"
ensure_kernel
build_initramfs
phase "setup: build udrive"
build_udrive
case $BACKEND in
file | rbd | qcow2) ;;
*) die "UDRIVE_MIGRATE_BACKEND=$BACKEND: file, rbd or qcow2" ;;
esac
[ "$BACKEND" = file ] || [ "$SERVER" = udrive ] || die "UDRIVE_MIGRATE_SERVER=qsd serves a file only"
case $STORAGE in
shared) ;;
nbd) [ "$BACKEND" = qcow2 ] || die "UDRIVE_MIGRATE_STORAGE=nbd mirrors a qcow2 disk: set UDRIVE_MIGRATE_BACKEND=qcow2" ;;
*) die "UDRIVE_MIGRATE_STORAGE=$STORAGE: shared or nbd" ;;
esac
if [ "$SERVER" = qsd ]; then
    command -v qemu-storage-daemon >/dev/null || die "UDRIVE_MIGRATE_SERVER=qsd: no qemu-storage-daemon on the host"
    [ "$SKIP_DIRTY" = 0 ] && [[ $DISK_OPTS == *shared* ]] || die "UDRIVE_MIGRATE_SERVER=qsd: only the shared-file run applies"
    say "serving the disk with $(qemu-storage-daemon --version | head -n1)"
fi
[ "$SKIP_DIRTY" != 1 ] || say "UDRIVE_MIGRATE_SKIP_DIRTY_DATA=1: udrive does not log read data; this run must report mismatches"

if [ "$BACKEND" = rbd ]; then
    phase "setup: Ceph cluster"
    start_ceph
    DISK_OPTS=''
elif [ "$BACKEND" = qcow2 ]; then
    # Empty over its base: every guest write allocates, so each process must see
    # the clusters and tables the other one wrote before it took the image over.
    # The base holds a pattern past migcheck's region, which a stream started on
    # A copies up while the VM migrates (stream_* below).
    qemu-img create -q -f qcow2 "$TMP/base.qcow2" "${DISK_MIB}M"
    qemu-io -f qcow2 -c "write -q -P 0x5a ${CHECK_MIB}M $((DISK_MIB - CHECK_MIB))M" "$TMP/base.qcow2" >/dev/null ||
        die "qemu-io could not fill base.qcow2"
    qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 "$TMP/disk.qcow2" "${DISK_MIB}M"
    DISK_SPEC="qcow2:$TMP/disk.qcow2"
    DISK_OPTS=''
else
    truncate -s "${DISK_MIB}M" "$TMP/disk.img"
    DISK_SPEC="file:$TMP/disk.img"
fi

phase "guest on QEMU 1 (udrive A)"
# Two processes serve the same disk: A the source, B the destination (`incoming`).
start_udrive a "$DISK_SPEC$DISK_OPTS"
if [ "$STORAGE" = nbd ]; then
    # B's own image, on storage A does not see.
    start_udrive b "qcow2:$TMP/moved.qcow2,create=${DISK_MIB}M"
else
    start_udrive b "$DISK_SPEC$DISK_OPTS,incoming"
fi
# The knob exists only in the udrive that `cargo test` builds (vhost-user-blk's
# `test-knobs` feature); a product build would silently log as usual.
if [ "$SKIP_DIRTY" = 1 ] && ! grep -q 'UDRIVE_TEST_SKIP_DIRTY_DATA=1: read data is not marked' "$TMP/udrive-a.log"; then
    die "$UDRIVE has no test knobs (UDRIVE_TEST_SKIP_DIRTY_DATA): use the binary \`cargo test -p udrive\` builds"
fi
start_qemu 1 a
wait_passes 1 "$PASSES" || HARNESS_FAIL+=("no migcheck passes on QEMU 1")

if [ "$STORAGE" = nbd ]; then
    phase "mirror A's disk into B's NBD export"
    mirror_to_b
    phase "migrate QEMU 1 (udrive A) -> QEMU 2 (udrive B, its own image)"
    hop 1 2 b
    mirror_complete
else
    [ "$BACKEND" != qcow2 ] || stream_start
    phase "migrate QEMU 1 (udrive A) -> QEMU 2 (udrive B)"
    hop 1 2 b
    [ "$BACKEND" != qcow2 ] || stream_waits
    phase "migrate back QEMU 2 (udrive B) -> QEMU 3 (udrive A)"
    hop 2 3 a
    [ "$BACKEND" != qcow2 ] || stream_finishes
fi
LAST=${#QEMU_PIDS[@]}
phase "final check on QEMU $LAST"
timeout 5 sh -c 'printf "stop\n" >"$1"' - "$TMP/ctl-$LAST.in" || say "could not write to ttyS1 of QEMU $LAST"
QEMU_PID=${QEMU_PIDS[$LAST]}
watch_guest "$TMP/console-$LAST.log" "$TIMEOUT"
for n in "${!UDRIVE_PIDS[@]}"; do
    stop_pid "${UDRIVE_PIDS[$n]}"
    errors=$(grep -E 'panicked| ERROR ' "$TMP/udrive-$n.log" | head -n 2 | tr '\n' ' ' | cut -c1-240 || true)
    if [ "$STOP_RC" = 0 ] && [ -z "$errors" ]; then
        host_result "udrive-$n-clean-exit" PASS "exited 0 on SIGTERM; no panics or ERROR lines"
    else
        host_result "udrive-$n-clean-exit" FAIL "exit status $STOP_RC; $errors"
    fi
done
phase ""

# Without `shared` the disk's writer claim (the file's range lock, the image's
# exclusive lock) moved at each switch-over: A gave it up and took it back, B took
# it and gave it up.
if [[ $DISK_OPTS != *shared* ]] && [ "$STORAGE" = shared ]; then
    claims=''
    for n in a b; do
        claims+=" $n: $(grep -c 'this device no longer writes it' "$TMP/udrive-$n.log" || true) released,"
        claims+=" $(grep -c 'this device writes it now' "$TMP/udrive-$n.log" || true) taken;"
    done
    if [ "$claims" = " a: 1 released, 1 taken; b: 1 released, 1 taken;" ]; then
        host_result writer-claim-moved PASS "the $BACKEND disk's writer claim moved with the VM:$claims"
    else
        host_result writer-claim-moved FAIL "want each process to release and take the claim once:$claims"
    fi
fi

# Both processes wrote the image's metadata in turn: it must still be whole.
# Without shared storage the guest's disk is B's image from the switch-over on.
GUEST_IMAGE=$TMP/disk.qcow2
[ "$STORAGE" = shared ] || GUEST_IMAGE=$TMP/moved.qcow2
if [ "$BACKEND" = qcow2 ]; then
    stream_check
    checks=(qcow2-check "$TMP/disk.qcow2")
    [ "$STORAGE" = shared ] || checks+=(qcow2-check-destination "$GUEST_IMAGE")
    for ((i = 0; i < ${#checks[@]}; i += 2)); do
        if out=$(qemu-img check "${checks[i + 1]}" 2>&1); then
            host_result "${checks[i]}" PASS "qemu-img check: $(echo "$out" | grep -m1 -E 'No errors|allocated' | cut -c1-100)"
        else
            host_result "${checks[i]}" FAIL "qemu-img check: $(echo "$out" | tr '\n' ' ' | cut -c1-200)"
        fi
    done
fi

cat "$TMP"/console-*.log >"$TMP/console.log"
guest_results "$TMP/console.log"
bad=$(grep -a '^MIGCHECK pass=' "$TMP/console.log" | grep -vc ' bad=0 ' || true)
passes=$(grep -ac '^MIGCHECK pass=' "$TMP/console.log" || true)
final=$(grep -a '^MIGCHECK final' "$TMP/console.log" | tr -d '\r' | tail -n1 || true)
grep -a '^MIGCHECK mismatch' "$TMP/console.log" | head -n 5 | sed 's/^/  /' || true
if [ -n "$final" ] && [ "$bad" = 0 ] && grep -q ' bad=0 ' <<<"$final"; then
    host_result guest-data PASS "$passes passes on $LAST QEMUs, none with a mismatch; $final"
else
    host_result guest-data FAIL "$bad of $passes passes with mismatches; ${final:-no final check} ${HARNESS_FAIL[*]}"
fi
gen=$(grep -oE 'final gen=[0-9]+' <<<"$final" | grep -oE '[0-9]+$' || true)
if [ "$BACKEND" = rbd ]; then
    rbd --conf "$CEPH_CONF" export --no-progress rbd/mig "$TMP/disk.img" >/dev/null 2>&1 ||
        say "rbd export rbd/mig failed"
elif [ "$BACKEND" = qcow2 ]; then
    qemu-img convert -f qcow2 -O raw "$GUEST_IMAGE" "$TMP/disk.img" || say "qemu-img convert of $GUEST_IMAGE failed"
fi
if [ -n "$gen" ] && out=$("$TMP/migcheck-host" verify "$TMP/disk.img" "$CHECK_MIB" "$gen" 2>&1); then
    host_result backing-file PASS "$out"
else
    host_result backing-file FAIL "${out:-no final generation from the guest}"
fi
report "$TMP/console.log" "$TMP"/udrive-a.log "$TMP"/udrive-b.log "$TMP"/qemu-*.log
