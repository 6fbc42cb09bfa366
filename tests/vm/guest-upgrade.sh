#!/bin/sh
# /init of the live-handover VM tests: UDRIVE_VM_UPGRADE=1 of tests/vm
# (NVMe, /dev/nvme0n1) and UDRIVE_VM_VHOST_UPGRADE=1 of tests/vm-vhost
# (virtio-blk, /dev/vda; the virtio modules are in /lib/modules). See the READMEs.
# One boot:
#   fio (4 KiB random writes, iodepth 32 per vCPU, crc32c verify) runs in the
#   background; N times while it writes (requests in flight) the guest prints
#     UDRIVE-UPGRADE n=N
#   and the host runs `udrive upgrade` (a new udrive process takes the device
#   over), then answers on ttyS1 ("upgraded ..." or "failed ..."). Meanwhile the
#   guest watches its completed-request counter with builtins only and reports
#   the longest time none completed, from its request until one completes after
#   the host's answer: what the guest saw of the upgrade.
# Checks: each upgrade's pause, fio exit 0 with no verify errors, the device still
# works, and dmesg: no controller reset and no I/O error. Then `poweroff -f` after
# UDRIVE-DONE phase=1. Results: UDRIVE-RESULT lines, like guest-init.sh.
# Kernel command line: udrive.dev=nvme0n1|vda, udrive.upgrades=N, udrive.job_mib=M.

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
echo 1 >/proc/sys/kernel/printk

arg() { sed -n "s/.*udrive\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
BLK=$(arg dev)
BLK=${BLK:-nvme0n1}
DEV=/dev/$BLK
NCPU=$(nproc)
MIB=1048576
UPGRADES=$(arg upgrades)
UPGRADES=${UPGRADES:-3}
# Per fio job (one per vCPU): this many MiB of 4 KiB random writes, each job in
# its own range. Enough that the writing outlasts every upgrade.
JOB_MIB=$(arg job_mib)
JOB_MIB=${JOB_MIB:-256}
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
t_modules() {
    for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk; do
        insmod /lib/modules/$m.ko || { DETAIL="insmod $m failed"; return 1; }
    done
    DETAIL="loaded: $(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"
}
wait_for_disk() {
    i=0
    while [ ! -b "$DEV" ]; do
        i=$((i + 1))
        [ $i -gt 300 ] && { DETAIL="no $DEV after 30 s; dmesg: $(dmesg | grep -iE 'nvme|virtio' | tail -n 3)"; return 1; }
        sleep 0.1
    done
    DETAIL="$DEV after $((i / 10)).$((i % 10)) s"
    [ -f /sys/class/nvme/nvme0/model ] && DETAIL="$DETAIL, $(sed 's/ *$//' /sys/class/nvme/nvme0/model), io_timeout ${IO_TIMEOUT}s"
    DETAIL="$DETAIL, $(ls "/sys/block/$BLK/mq" | wc -l) queues"
}
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# For the sampling loop, builtins only (no fork): t = centiseconds of uptime,
# w = completed requests (reads + writes: fio's verify pass reads).
sample() {
    read -r up _ </proc/uptime
    read -r rd _ _ _ w _ <"/sys/block/$BLK/stat"
    t=$((${up%.*} * 100 + 1${up#*.} - 100)) w=$((rd + w))
}
writes_inflight() { read -r _ w <"/sys/block/$BLK/inflight"; echo "$w"; }
writes_completed() { read -r _ _ _ _ w _ <"/sys/block/$BLK/stat"; echo "$w"; }
# fio is writing: requests in flight, or writes completing within 50 ms (with one
# vCPU a fast disk completes them before this shell runs again).
fio_writing() {
    [ "$(writes_inflight)" = 0 ] || return 0
    c=$(writes_completed)
    sleep 0.05
    [ "$(writes_inflight)" != 0 ] || [ "$(writes_completed)" != "$c" ]
}
fio_running() { kill -0 "$FIO_PID" 2>/dev/null; }
secs() { echo "$(($1 / 100)).$(printf '%02d' $(($1 % 100)))"; } # centiseconds -> s
# Controller resets the NVMe driver logs (nvme_timeout: "controller is down; will
# reset"; nvme_reset_work); virtio_blk has none.
RESET_RE='will reset|reset(ting)? controller'
resets() { dmesg | grep -cE "$RESET_RE"; }
# What must never reach the block layer or a filesystem.
IOERR_RE="I/O error|Buffer I/O|blk_update_request|print_req_error|critical (medium|target)|$BLK: .*error|Abort status|disable controller|removing|virtio.*(error|broken)"
# The host's answers (ttyS1), collected by a background cat into /tmp/ctl: their
# number in $a (builtins only).
count_answers() {
    a=0
    while read -r _; do a=$((a + 1)); done </tmp/ctl
}

# One upgrade: wait until fio writes, ask the host, then
# sample the completed writes until the host answered and writes completed after
# that; the pause is the longest span in which no write completed.
t_upgrade() { # upgrade number $UPG_N
    n=$UPG_N
    i=0
    while ! fio_writing; do
        i=$((i + 1))
        if ! fio_running || [ $i -ge 100 ]; then
            DETAIL="no write in flight or completed for 5 s (fio $(fio_running && echo running || echo finished: make udrive.job_mib larger))"
            return 1
        fi
        sleep 0.05
    done
    count_answers
    r0=$(resets) a0=$a
    sample
    w0=$w t0=$t
    echo "UDRIVE-UPGRADE n=$n inflight_writes=$(writes_inflight) completed=$w0" >&4
    last_w=$w0 last_t=$t0 gap=0 gap_at=0 samples=0 t_ans='' w_ans=''
    while :; do
        sample
        samples=$((samples + 1))
        if [ "$w" != "$last_w" ]; then
            [ $((t - last_t)) -le "$gap" ] || { gap=$((t - last_t)) gap_at=$((last_t - t0)); }
            last_w=$w last_t=$t
            # Done: the host answered, and a request completed after its answer.
            [ -n "$w_ans" ] && [ "$w" != "$w_ans" ] && break
        fi
        # (fio ended meanwhile: nothing left to complete.)
        [ -z "$w_ans" ] || fio_running || break
        if [ -z "$t_ans" ]; then
            count_answers
            [ "$a" -le "$a0" ] || t_ans=$t w_ans=$w
        fi
        if [ $((t - t0)) -ge 12000 ]; then
            DETAIL="no request completed 120 s after asking for upgrade $n (host: $(tail -n 1 /tmp/ctl))"
            return 1
        fi
        sleep 0.02
    done
    # The span still open when sampling ended counts too.
    [ $((t - last_t)) -le "$gap" ] || { gap=$((t - last_t)) gap_at=$((last_t - t0)); }
    r=$(($(resets) - r0))
    ans=$(tail -n 1 /tmp/ctl | tr -d '\r')
    DETAIL="pause $(secs "$gap") s (longest span without a request completing, from $(secs "$gap_at") s after asking; $samples samples over $(secs $((t - t0))) s); host answered after $(secs $((t_ans - t0))) s: $ans; controller resets meanwhile: $r"
    case "$ans" in upgraded*) ;; *) return 1 ;; esac
}
t_fio_done() {
    wait "$FIO_PID"
    rc=$?
    cat /tmp/fio.out
    bw=$(grep -E '^ *(READ|WRITE):' /tmp/fio.out | sed 's/^ *\([A-Z]*\): bw=\([^ ]*\).*/\1 \2/' | tr '\n' ' ')
    errs=$(grep -oE 'err= *[0-9]+' /tmp/fio.out | tr -d ' ' | sort -u | tr '\n' ' ')
    bad=$(grep -ciE 'verify: bad|verify failed|bad magic|bad header' /tmp/fio.out)
    DETAIL="rc=$rc $bw${errs}verify_errors=$bad; $((NCPU * JOB_MIB)) MiB written and verified across $UPGRADES upgrades in $(since "$FIO_T0")s"
    [ "$rc" = 0 ] && [ "$bad" = 0 ]
}
t_dmesg() {
    n=$(resets)
    dmesg | grep -iE 'nvme|virtio|vda|blk|I/O'
    DETAIL="$n controller reset(s) in $UPGRADES upgrades (want 0: an upgrade is a pause, not a reset)"
    [ "$n" = 0 ] || DETAIL="$DETAIL:$(dmesg | grep -E "$RESET_RE" | sed 's/^\[[^]]*\] //; s/^/ |/' | head -n 6 | tr '\n' ' ')"
    if dmesg | grep -E "$IOERR_RE"; then
        DETAIL="$DETAIL; I/O errors: $(dmesg | grep -E "$IOERR_RE" | head -n 2 | tr '\n' ' ')"
        return 1
    fi
    DETAIL="$DETAIL; no I/O errors"
    [ "$n" = 0 ]
}
t_state() {
    DETAIL="$(ls "/sys/block/$BLK/mq" | wc -l) queues"
    if [ -f /sys/class/nvme/nvme0/state ]; then
        DETAIL="nvme0 $(cat /sys/class/nvme/nvme0/state), $DETAIL"
        [ "$(cat /sys/class/nvme/nvme0/state)" = live ] || return 1
    fi
    # A last direct write and read back through the device the new process serves.
    dd if=/dev/urandom of=/tmp/last bs=64k count=1 2>/dev/null
    dd if=/tmp/last of="$DEV" bs=64k seek=$((NCPU * JOB_MIB * 16)) oflag=direct 2>&1 || return 1
    dd if="$DEV" bs=64k skip=$((NCPU * JOB_MIB * 16)) count=1 iflag=direct 2>/dev/null | cmp - /tmp/last || return 1
    DETAIL="$DETAIL; a 64 KiB write reads back"
}

# The host answers on ttyS1 (a QEMU pipe chardev), kept open all along so nothing
# it sends is dropped. Fd 4 is the console, for markers the host must see while a
# check's own output goes to /tmp/out.
stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null
exec 3</dev/ttyS1 4>&1
: >/tmp/ctl
cat <&3 >>/tmp/ctl &
[ ! -d /lib/modules ] || run modules t_modules
wait_for_disk >/tmp/out 2>&1
if [ ! -b "$DEV" ]; then
    result enumerate FAIL "$DETAIL"
    dmesg | tail -n 40
    finish 1
fi
echo "UDRIVE-BOOT phase=1 cpus=$NCPU kernel=$(uname -r) uptime=$(now)s"
result enumerate PASS "$DETAIL"
[ "$(($(cat "/sys/block/$BLK/size") * 512))" -gt $((NCPU * JOB_MIB * MIB)) ] ||
    { result disk-size FAIL "$DEV smaller than $((NCPU * JOB_MIB)) MiB + 64 KiB"; finish 1; }

FIO_T0=$(now)
fio --name=upgrade --filename="$DEV" --direct=1 --ioengine=libaio --thread --group_reporting \
    --numjobs="$NCPU" --cpus_allowed=0-$((NCPU - 1)) --cpus_allowed_policy=split \
    --rw=randwrite --bs=4k --iodepth=32 --size="${JOB_MIB}M" --offset_increment="${JOB_MIB}M" \
    --verify=crc32c --do_verify=1 --verify_dump=0 >/tmp/fio.out 2>&1 &
FIO_PID=$!
# Let it write for a moment before the first upgrade.
sleep 2
UPG_N=1
while [ $UPG_N -le "$UPGRADES" ]; do
    run "upgrade-$UPG_N-pause" t_upgrade
    UPG_N=$((UPG_N + 1))
    sleep 1
done
run fio-verify-across-upgrades t_fio_done
run device-live t_state
run dmesg-no-reset-no-io-errors t_dmesg
finish 1
