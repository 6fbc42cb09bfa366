#!/bin/sh
# /init of the crash-recovery VM test (UDRIVE_VM_SUPERVISE=1, see tests/vm/README.md):
# udrive runs under `serve --supervise` with a file namespace. One boot:
#   fio (4 KiB random writes, iodepth 32 per vCPU, crc32c verify) runs in the
#   background; twice while it writes, the guest prints
#     UDRIVE-CRASH n=N
#   and the host SIGKILLs udrive's server process (the supervisor restarts it and
#   hands the client back; the controller then shows fatal status). The driver
#   notices when a request times out (nvme_core.io_timeout on the kernel command
#   line), resets the controller and retries what was in flight. fio must finish
#   with exit 0 and no verify errors; dmesg must show one controller reset per
#   crash and no I/O errors. Then `poweroff -f` after UDRIVE-DONE phase=1.
# Results: UDRIVE-RESULT lines, like guest-init.sh.

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
echo 1 >/proc/sys/kernel/printk

DEV=/dev/nvme0n1
NCPU=$(nproc)
MIB=1048576
# Per fio job (one per vCPU): this many MiB of 4 KiB random writes, each job in
# its own range. Enough that the writing outlasts both crashes.
JOB_MIB=256
CRASHES=$(sed -n 's/.*udrive\.crashes=\([0-9]*\).*/\1/p' /proc/cmdline)
CRASHES=${CRASHES:-2}
IO_TIMEOUT=$(cat /sys/module/nvme_core/parameters/io_timeout 2>/dev/null)

# shellcheck source=tests/vm/guest-lib.sh
. /guest-lib.sh
finish() { # finish PHASE
    sync
    echo "UDRIVE-DONE phase=$1"
    sleep 0.5
    poweroff -f
    sleep 30
}
wait_for_disk() {
    i=0
    while [ ! -b $DEV ]; do
        i=$((i + 1))
        [ $i -gt 300 ] && { DETAIL="no $DEV after 30 s; dmesg: $(dmesg | grep -i nvme | tail -n 3)"; return 1; }
        sleep 0.1
    done
    DETAIL="$DEV after $((i / 10)).$((i % 10)) s, $(sed 's/ *$//' /sys/class/nvme/nvme0/model), io_timeout ${IO_TIMEOUT}s"
}
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
writes_done() { awk '{ print $5 }' /sys/block/nvme0n1/stat; }     # write requests completed
writes_inflight() { awk '{ print $2 }' /sys/block/nvme0n1/inflight; }
fio_running() { kill -0 "$FIO_PID" 2>/dev/null; }
# Controller resets the driver logged (nvme_timeout: "controller is down; will reset").
RESET_RE='will reset|reset(ting)? controller'
resets() { dmesg | grep -cE "$RESET_RE"; }
# What must never reach the block layer or a filesystem.
IOERR_RE='I/O error|Buffer I/O|blk_update_request|print_req_error|critical (medium|target)|nvme0n1: .*error|Abort status|disable controller|removing'

# One crash: wait until fio is writing with requests in flight, ask the host to
# kill the server, wait for the driver's reset and for writes to complete again.
t_crash() { # crash number $CRASH_N
    n=$CRASH_N
    i=0
    while [ "$(writes_inflight)" = 0 ]; do
        i=$((i + 1))
        if ! fio_running || [ $i -ge 100 ]; then
            DETAIL="no writes in flight for 5 s (fio $(fio_running && echo running || echo finished))"
            return 1
        fi
        sleep 0.05
    done
    r0=$(resets) w0=$(writes_done) t0=$(now)
    echo "UDRIVE-CRASH n=$n inflight_writes=$(writes_inflight) writes_done=$w0" >&4
    # The driver sees CSTS.CFS when a request times out (io_timeout) and resets.
    while [ "$(resets)" -le "$r0" ]; do
        [ "$(since "$t0" | cut -d. -f1)" -lt 90 ] || { DETAIL="no controller reset 90 s after asking for crash $n"; return 1; }
        sleep 0.1
    done
    t_reset=$(since "$t0")
    w1=$(writes_done)
    while [ "$(writes_done)" -le "$w1" ]; do
        [ "$(since "$t0" | cut -d. -f1)" -lt 120 ] || { DETAIL="writes did not resume 120 s after asking for crash $n"; return 1; }
        sleep 0.1
    done
    DETAIL="asked at $w0 writes done; reset seen after ${t_reset}s, writes completing again after $(since "$t0")s ($(dmesg | grep -E "$RESET_RE" | tail -n1 | sed 's/^\[[^]]*\] //'))"
}
t_fio_done() {
    wait "$FIO_PID"
    rc=$?
    cat /tmp/fio.out
    bw=$(grep -E '^ *(READ|WRITE):' /tmp/fio.out | sed 's/^ *\([A-Z]*\): bw=\([^ ]*\).*/\1 \2/' | tr '\n' ' ')
    errs=$(grep -oE 'err= *[0-9]+' /tmp/fio.out | tr -d ' ' | sort -u | tr '\n' ' ')
    bad=$(grep -ciE 'verify: bad|verify failed|bad magic|bad header' /tmp/fio.out)
    DETAIL="rc=$rc $bw${errs}verify_errors=$bad; $((NCPU * JOB_MIB)) MiB written and verified across $CRASHES crashes in $(since "$FIO_T0")s"
    [ "$rc" = 0 ] && [ "$bad" = 0 ]
}
t_dmesg() {
    n=$(resets)
    DETAIL="$n controller reset(s) for $CRASHES crashes:$(dmesg | grep -E "$RESET_RE" | sed 's/^\[[^]]*\] //; s/^/ |/' | tr '\n' ' ')"
    dmesg | grep -iE 'nvme|blk|I/O'
    if dmesg | grep -E "$IOERR_RE"; then
        DETAIL="$DETAIL; I/O errors: $(dmesg | grep -E "$IOERR_RE" | head -n 2 | tr '\n' ' ')"
        return 1
    fi
    DETAIL="$DETAIL; no I/O errors"
    [ "$n" = "$CRASHES" ]
}
t_state() {
    DETAIL="nvme0 $(cat /sys/class/nvme/nvme0/state), $(ls /sys/block/nvme0n1/mq | wc -l) I/O queues"
    [ "$(cat /sys/class/nvme/nvme0/state)" = live ] || return 1
    # A last direct write and read back through the controller the host restarted.
    dd if=/dev/urandom of=/tmp/last bs=64k count=1 2>/dev/null
    dd if=/tmp/last of=$DEV bs=64k seek=$((NCPU * JOB_MIB * 16)) oflag=direct 2>&1 || return 1
    dd if=$DEV bs=64k skip=$((NCPU * JOB_MIB * 16)) count=1 iflag=direct 2>/dev/null | cmp - /tmp/last || return 1
    DETAIL="$DETAIL; a 64 KiB write reads back"
}

exec 4>&1
wait_for_disk >/tmp/out 2>&1
if [ ! -b $DEV ]; then
    result enumerate FAIL "$DETAIL"
    dmesg | tail -n 40
    finish 1
fi
echo "UDRIVE-BOOT phase=1 cpus=$NCPU kernel=$(uname -r) uptime=$(now)s"
result enumerate PASS "$DETAIL"
[ "$(($(cat /sys/block/nvme0n1/size) * 512))" -gt $((NCPU * JOB_MIB * MIB)) ] ||
    { result disk-size FAIL "$DEV smaller than $((NCPU * JOB_MIB)) MiB + 64 KiB"; finish 1; }

FIO_T0=$(now)
fio --name=crash --filename=$DEV --direct=1 --ioengine=libaio --thread --group_reporting \
    --numjobs="$NCPU" --cpus_allowed=0-$((NCPU - 1)) --cpus_allowed_policy=split \
    --rw=randwrite --bs=4k --iodepth=32 --size=${JOB_MIB}M --offset_increment=${JOB_MIB}M \
    --verify=crc32c --do_verify=1 --verify_dump=0 >/tmp/fio.out 2>&1 &
FIO_PID=$!
# Let it write for a moment before the first crash.
sleep 2
CRASH_N=1
while [ $CRASH_N -le "$CRASHES" ]; do
    run "crash-$CRASH_N-recovered" t_crash
    CRASH_N=$((CRASH_N + 1))
    sleep 1
done
run fio-verify-across-crashes t_fio_done
run controller-live t_state
run dmesg-resets-no-io-errors t_dmesg
finish 1
