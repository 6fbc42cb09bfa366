#!/bin/sh
# /init of the udrive VM test guest (busybox initramfs, see tests/vm/README.md).
#
# Boots twice without QEMU exiting:
#   phase 1: checks the NVMe controller (identify, logs, queues, interrupts,
#            fio with verify, flush, discard, format), has the host resize the
#            namespace (grow, then shrink) and follows its size, leaves data and a
#            marker block on the disk, then `reboot -f` (a warm reboot: the
#            controller is reset).
#   phase 2: finds the marker, checks the controller came back, the size and the
#            data are intact, then `poweroff -f` (QEMU exits).
# Each check prints one line on the serial console, parsed by tests/vm/run.sh:
#   UDRIVE-RESULT name=NAME status=PASS|FAIL detail=TEXT
# Other markers: UDRIVE-BOOT phase=N, UDRIVE-DONE phase=N, and
#   UDRIVE-RESIZE nsid=N bytes=B shrink=0|1   asks the host to resize (the `resize` RPC)
#   UDRIVE-RBD-CLONE                           asks the host to clone rbd/gold@base and
#                                              hot-add it as namespace 3 (udrive.rbd=1)
#   UDRIVE-RBD-DATA off=O len=L sha256=S       the host checks the image with rbd export
#   UDRIVE-QCOW2-ADD / -SNAP / -DATA sha256=S  the qcow2 overlay (udrive.qcow2=NSID):
#                                              hot-add, snapshot + commit, data check

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /tmp /dev/shm && mount -t tmpfs tmpfs /tmp
# Keep kernel messages off the console so result lines stay whole; dmesg is
# checked explicitly instead.
echo 1 >/proc/sys/kernel/printk

CTRL=/dev/nvme0
DEV=/dev/nvme0n1
FMT_DEV=/dev/nvme0n2         # second namespace: only the format check uses it
NCPU=$(nproc)
MIB=1048576
# Disk layout (byte offsets; the namespace must be >= 256 MiB):
FIO_OFF=0                    # fio jobs: 2 x 16 MiB (4k), 2 x 32 MiB (mixed) after it
DISCARD_OFF=$((160 * MIB))   # discard test: 4 MiB
PERSIST_OFF=$((192 * MIB))   # data kept across the reboot: 8 MiB
MAGIC_OFF=$((255 * MIB))     # one 4 KiB marker block
PERSIST_MIB=8

# log, result and run: the reporting both VM tests share (packed by initramfs_pack).
# shellcheck source=tests/vm/guest-lib.sh
. /guest-lib.sh
short() { echo "$1" | cut -c1-12; }
field() { sed -n "s/^$1[[:space:]]*:[[:space:]]*//p" | head -n1 | sed 's/[[:space:]]*$//'; }
irqs() { # total interrupts of the vector named $1 over all CPUs
    awk -v q="$1" -v n="$NCPU" '$NF == q { s = 0; for (i = 2; i <= n + 1; i++) s += $i; print s; f = 1 }
        END { if (!f) print -1 }' /proc/interrupts
}
fail_on_dmesg() {
    dmesg | grep -iE 'nvme.*(timeout|abort|reset|fail|error)|I/O error|Buffer I/O|blk_update_request|critical' && return 1
    return 0
}
finish() { # finish PHASE reboot|poweroff
    sync
    echo "UDRIVE-DONE phase=$1"
    sleep 0.5
    "$2" -f
    sleep 30
}

wait_for_disk() {
    i=0
    while [ ! -b $DEV ]; do
        i=$((i + 1))
        [ $i -gt 300 ] && { DETAIL="no $DEV after 30 s; dmesg: $(dmesg | grep -i nvme | tail -n 3)"; return 1; }
        sleep 0.1
    done
    DETAIL="$DEV after $((i / 10)).$((i % 10)) s, $(sed 's/ *$//' /sys/class/nvme/nvme0/model)"
}

# ---------------------------------------------------------------- checks
t_id_ctrl() {
    nvme id-ctrl $CTRL >/tmp/idctrl || return 1
    mn=$(field mn </tmp/idctrl) sn=$(field sn </tmp/idctrl) fr=$(field fr </tmp/idctrl)
    mdts=$(field mdts </tmp/idctrl) oacs=$(field oacs </tmp/idctrl) oncs=$(field oncs </tmp/idctrl)
    nn=$(field nn </tmp/idctrl) vwc=$(field vwc </tmp/idctrl)
    DETAIL="mn='$mn' sn='$sn' fr='$fr' mdts=$mdts oacs=$oacs oncs=$oncs nn=$nn vwc=$vwc"
    cat /tmp/idctrl
    case "$mn" in *udrive*) ;; *) return 1 ;; esac
    [ -n "$sn" ] && [ -n "$fr" ] && [ "${mdts:-0}" -gt 0 ] && [ "${nn:-0}" -ge 1 ]
}
t_id_ns() {
    nvme id-ns $DEV >/tmp/idns || return 1
    cat /tmp/idns
    nsze=$(field nsze </tmp/idns) flbas=$(field flbas </tmp/idns) dlfeat=$(field dlfeat </tmp/idns)
    lbaf=$(grep 'in use' /tmp/idns | head -n1)
    lbads=$(echo "$lbaf" | sed -n 's/.*lbads:\([0-9]*\).*/\1/p')
    bytes=$((nsze * (1 << ${lbads:-0})))
    sys=$(($(cat /sys/block/nvme0n1/size) * 512))
    DETAIL="nsze=$nsze ($((bytes / MIB)) MiB) flbas=$flbas lba=$((1 << ${lbads:-0}))B dlfeat=$dlfeat"
    [ "$nsze" != "" ] && [ $((nsze)) -gt 0 ] && [ "$bytes" = "$sys" ] && [ -n "$lbads" ] &&
        [ $bytes -ge $((256 * MIB)) ] || { DETAIL="$DETAIL (sysfs says $sys bytes; need >= 256 MiB)"; return 1; }
}
t_smart_log() {
    nvme smart-log $CTRL >/tmp/smart || return 1
    cat /tmp/smart
    cw=$(field critical_warning </tmp/smart) temp=$(field temperature </tmp/smart)
    spare=$(field available_spare </tmp/smart)
    DETAIL="critical_warning=$cw temperature='$temp' available_spare=$spare"
    [ "$((cw))" = 0 ]
}
t_error_log() {
    nvme error-log $CTRL -e 4 >/tmp/errlog || return 1
    cat /tmp/errlog
    DETAIL="$(grep -c 'Entry' /tmp/errlog) entries; newest: error_count=$(field error_count </tmp/errlog)"
    DETAIL="$DETAIL sqid=$(field sqid </tmp/errlog) cmdid=$(field cmdid </tmp/errlog) status=$(field status_field </tmp/errlog)"
}
t_list() {
    nvme list >/tmp/list || return 1
    cat /tmp/list
    line=$(grep nvme0n1 /tmp/list | tr -s ' ')
    DETAIL="$line"
    echo "$line" | grep -q udrive
}
t_dbbuf_advertised() {
    oacs=$(field oacs </tmp/idctrl)
    DETAIL="oacs=$oacs (bit 8 = Doorbell Buffer Config)"
    [ $((oacs & 0x100)) -ne 0 ]
}
# Error Recovery (05h) and Write Atomicity Normal (0Ah) are mandatory; drivers query
# Host Behavior Support (16h, a 512-byte structure). docs/decisions/0011.
t_features() {
    DETAIL=""
    for f in 0x5 0xa 0x16; do
        if [ $f = 0x16 ]; then
            nvme get-feature $CTRL -f $f -l 512 >/tmp/feat 2>&1 || { DETAIL="$DETAIL $f: $(tail -n1 /tmp/feat)"; return 1; }
        else
            nvme get-feature $CTRL -f $f >/tmp/feat 2>&1 || { DETAIL="$DETAIL $f: $(tail -n1 /tmp/feat)"; return 1; }
        fi
        cat /tmp/feat
        DETAIL="$DETAIL $f: $(grep -io 'current value:[^,]*' /tmp/feat | head -n1)"
    done
}
t_io_queues() {
    nq=$(ls /sys/block/nvme0n1/mq | wc -l)
    DETAIL="$nq blk-mq hw queues for $NCPU vCPUs;"
    i=1
    while [ $i -le "$NCPU" ]; do
        c=$(irqs nvme0q$i)
        DETAIL="$DETAIL nvme0q$i: cpus $(cat /sys/block/nvme0n1/mq/$((i - 1))/cpu_list 2>/dev/null) irqs=$c;"
        [ "$c" -ge 0 ] || return 1
        i=$((i + 1))
    done
    grep nvme /proc/interrupts
    [ "$nq" = "$NCPU" ]
}

# fio NAME ARGS...: one job per vCPU (pinned), direct I/O, exit code + summary.
FIO_COMMON="--filename=$DEV --direct=1 --ioengine=libaio --thread --group_reporting
    --numjobs=$NCPU --cpus_allowed=0-$((NCPU - 1)) --cpus_allowed_policy=split"
fio_run() {
    n=$1
    shift
    # shellcheck disable=SC2086
    fio --name="$n" $FIO_COMMON "$@" >/tmp/fio.out 2>&1
    rc=$?
    cat /tmp/fio.out
    bw=$(grep -E '^ *(READ|WRITE):' /tmp/fio.out | sed 's/^ *\([A-Z]*\): bw=\([^ ]*\).*/\1 \2/' | tr '\n' ' ')
    errs=$(grep -oE 'err= *[0-9]+' /tmp/fio.out | tr -d ' ' | sort -u | tr '\n' ' ')
    DETAIL="rc=$rc $bw$errs"
    [ $rc = 0 ] && ! grep -qiE 'verify: bad|crc32c: verify failed|bad magic' /tmp/fio.out
}
t_fio_4k() {
    fio_run rand4k --rw=randwrite --bs=4k --iodepth=16 --size=16M --offset=$FIO_OFF \
        --offset_increment=16M --verify=crc32c --verify_fatal=1 --do_verify=1
}
t_fio_mixed() {
    fio_run mixed --rw=randwrite --bssplit=4k/25:16k/15:64k/20:256k/20:1m/20 \
        --blockalign=4k --iodepth=8 --size=32M --offset=$((FIO_OFF + 32 * MIB)) \
        --offset_increment=32M --verify=crc32c --verify_fatal=1 --do_verify=1
}
t_fio_seqread() {
    fio_run seqread --rw=read --bs=128k --iodepth=8 --size=48M --offset=0 --offset_increment=48M
}
t_fio_verify_again() { # re-verifies the 4k job's data (after the reboot)
    fio_run rand4k --rw=randwrite --bs=4k --iodepth=16 --size=16M --offset=$FIO_OFF \
        --offset_increment=16M --verify=crc32c --verify_fatal=1 --verify_only=1
}
t_irqs_grew() {
    DETAIL=
    ok=0
    i=1
    while [ $i -le "$NCPU" ]; do
        eval "before=\$IRQ_BEFORE_$i"
        now=$(irqs nvme0q$i)
        DETAIL="$DETAIL nvme0q$i: $before -> $now;"
        [ "$now" -gt "$before" ] || ok=1
        i=$((i + 1))
    done
    grep nvme /proc/interrupts
    return $ok
}
snapshot_irqs() {
    i=1
    while [ $i -le "$NCPU" ]; do
        eval "IRQ_BEFORE_$i=$(irqs nvme0q$i)"
        i=$((i + 1))
    done
}
t_flush() {
    # On the namespace's device: Linux refuses I/O commands through the controller's
    # character device once it has more than one namespace.
    nvme flush $DEV -n 1 || return 1
    dd if=/dev/urandom of=$DEV bs=4k count=1 seek=$((DISCARD_OFF / 4096 - 1)) conv=fsync 2>&1 || return 1
    DETAIL="nvme flush ok, fsync ok; write_cache=$(cat /sys/block/nvme0n1/queue/write_cache)"
}
t_discard() {
    max=$(cat /sys/block/nvme0n1/queue/discard_max_bytes)
    DETAIL="discard_max_bytes=$max"
    [ "$max" -gt 0 ] || return 1
    dd if=/dev/urandom of=/tmp/pattern bs=1M count=4 2>/dev/null
    dd if=/tmp/pattern of=$DEV bs=1M seek=$((DISCARD_OFF / MIB)) oflag=direct 2>&1 || return 1
    dd if=$DEV of=/tmp/back bs=1M skip=$((DISCARD_OFF / MIB)) count=4 iflag=direct 2>&1 || return 1
    cmp /tmp/pattern /tmp/back || { DETAIL="$DETAIL; written data did not read back"; return 1; }
    # Discard the middle 2 MiB; the first and last MiB must survive.
    blkdiscard -o $((DISCARD_OFF + MIB)) -l $((2 * MIB)) $DEV || return 1
    dd if=$DEV of=/tmp/back bs=1M skip=$((DISCARD_OFF / MIB)) count=4 iflag=direct 2>&1 || return 1
    dd if=/dev/zero of=/tmp/zero bs=1M count=2 2>/dev/null
    dd if=/tmp/back bs=1M skip=1 count=2 2>/dev/null | cmp - /tmp/zero ||
        { DETAIL="$DETAIL; discarded range does not read as zeroes"; return 1; }
    for m in 0 3; do
        dd if=/tmp/pattern bs=1M skip=$m count=1 2>/dev/null >/tmp/a
        dd if=/tmp/back bs=1M skip=$m count=1 2>/dev/null | cmp - /tmp/a ||
            { DETAIL="$DETAIL; data next to the discarded range changed"; return 1; }
    done
    DETAIL="$DETAIL; 2 MiB discarded, reads back zeroes, neighbours intact"
}
# Format NVM (docs/decisions/0011): the second namespace goes to LBA format 1
# (4096-byte blocks) with a User Data Erase and back to format 0 without one;
# each time the kernel sees the new block size and the old data reads as zeroes.
lbs() { cat /sys/block/nvme0n2/queue/logical_block_size; }
wait_lbs() { # wait_lbs SIZE: the kernel rescans after the format (AEN, passthru end)
    i=0
    while [ "$(lbs)" != "$1" ]; do
        i=$((i + 1))
        [ $i -gt 100 ] && return 1
        sleep 0.1
    done
}
reads_zero() { # reads_zero BYTES: the start of the namespace is all zero
    dd if=$FMT_DEV bs=4k count=$(($1 / 4096)) iflag=direct 2>/dev/null | cmp -s - /tmp/zero64k
}
t_format() {
    [ -b $FMT_DEV ] || { DETAIL="no $FMT_DEV"; return 1; }
    dd if=/dev/zero of=/tmp/zero64k bs=64k count=1 2>/dev/null
    dd if=/dev/urandom of=/tmp/fmtdata bs=64k count=1 2>/dev/null
    size=$(($(cat /sys/block/nvme0n2/size) * 512))
    DETAIL="lbs $(lbs)"
    dd if=/tmp/fmtdata of=$FMT_DEV bs=64k oflag=direct 2>&1 || return 1
    nvme format $FMT_DEV --lbaf=1 --ses=1 --force || { DETAIL="$DETAIL; nvme format --lbaf=1 --ses=1 failed"; return 1; }
    wait_lbs 4096 || { DETAIL="$DETAIL; logical_block_size stayed $(lbs)"; return 1; }
    nvme id-ns $FMT_DEV >/tmp/idns2 || return 1
    inuse=$(grep 'in use' /tmp/idns2 | head -n1)
    DETAIL="$DETAIL -> $(lbs) ($(echo "$inuse" | sed -n 's/^\(lbaf *[0-9]*\).*lbads:\([0-9]*\).*/\1 lbads:\2/p'))"
    case "$inuse" in *lbads:12*) ;; *) DETAIL="$DETAIL; id-ns: $inuse"; return 1 ;; esac
    [ $(($(cat /sys/block/nvme0n2/size) * 512)) = "$size" ] || { DETAIL="$DETAIL; size changed"; return 1; }
    reads_zero 65536 || { DETAIL="$DETAIL; old data still there after SES=1"; return 1; }
    dd if=/tmp/fmtdata of=$FMT_DEV bs=64k oflag=direct 2>&1 || return 1
    dd if=$FMT_DEV bs=64k count=1 iflag=direct 2>/dev/null | cmp - /tmp/fmtdata ||
        { DETAIL="$DETAIL; 4096-byte blocks do not read back"; return 1; }
    nvme format $FMT_DEV --lbaf=0 --ses=0 --force || { DETAIL="$DETAIL; nvme format --lbaf=0 failed"; return 1; }
    wait_lbs 512 || { DETAIL="$DETAIL; logical_block_size stayed $(lbs)"; return 1; }
    reads_zero 65536 || { DETAIL="$DETAIL; old data still there after SES=0"; return 1; }
    DETAIL="$DETAIL -> $(lbs); erased with SES 1 and 0; $((size / MIB)) MiB throughout"
}
t_dmesg_clean() {
    DETAIL="$(dmesg | grep -c nvme) nvme lines in dmesg, none with errors/timeouts/resets"
    fail_on_dmesg
}
# Online resize (docs/decisions/0018-online-resize.md): the host resizes namespace
# 1 over udrive's control socket when it sees UDRIVE-RESIZE; the controller sends a
# Namespace Attribute Changed event and the kernel's rescan updates the disk size.
ns_bytes() { echo $(($(cat /sys/block/nvme0n1/size) * 512)); }
wait_size() { # wait_size BYTES: until the kernel shows that size (60 s at most)
    i=0
    while [ "$(ns_bytes)" != "$1" ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && return 1
        sleep 0.1
    done
    WAITED="$((i / 10)).$((i % 10)) s"
}
ask_resize() { # ask_resize BYTES SHRINK
    echo "UDRIVE-RESIZE nsid=1 bytes=$1 shrink=$2" >&4
}
t_resize_grow() {
    old=$(ns_bytes)
    new=$((old + 256 * MIB))
    DETAIL="$((old / MIB)) MiB"
    # The last block before the old end, and 1 MiB right after it once grown.
    dd if=/dev/urandom of=/tmp/edge bs=4k count=1 2>/dev/null
    dd if=/tmp/edge of=$DEV bs=4k seek=$((old / 4096 - 1)) oflag=direct 2>&1 || return 1
    ask_resize $new 0
    wait_size $new || { DETAIL="$DETAIL; size stayed $(($(ns_bytes) / MIB)) MiB, want $((new / MIB))"; return 1; }
    nsze=$(nvme id-ns $DEV | field nsze)
    DETAIL="$DETAIL -> $((new / MIB)) MiB after $WAITED, id-ns nsze=$nsze"
    [ $((nsze * 512)) = $new ] || return 1
    dd if=/dev/urandom of=/tmp/grown bs=1M count=1 2>/dev/null
    dd if=/tmp/grown of=$DEV bs=1M seek=$((old / MIB)) oflag=direct 2>&1 || return 1
    dd if=$DEV of=/tmp/back bs=1M skip=$((old / MIB)) count=1 iflag=direct 2>&1 || return 1
    cmp /tmp/grown /tmp/back || { DETAIL="$DETAIL; the new space does not read back"; return 1; }
    dd if=$DEV bs=4k skip=$((old / 4096 - 1)) count=1 iflag=direct 2>/dev/null | cmp - /tmp/edge ||
        { DETAIL="$DETAIL; the block before the old end changed"; return 1; }
    DETAIL="$DETAIL; 1 MiB past the old end reads back, the block before it intact"
    GROWN_AT=$old
}
t_resize_shrink() {
    old=$(ns_bytes)
    new=$((old - 128 * MIB))
    DETAIL="$((old / MIB)) MiB"
    ask_resize $new 1
    wait_size $new || { DETAIL="$DETAIL; size stayed $(($(ns_bytes) / MIB)) MiB, want $((new / MIB))"; return 1; }
    DETAIL="$DETAIL -> $((new / MIB)) MiB after $WAITED"
    dd if=$DEV of=/tmp/back bs=1M skip=$((GROWN_AT / MIB)) count=1 iflag=direct 2>&1 || return 1
    cmp /tmp/grown /tmp/back || { DETAIL="$DETAIL; data below the new end changed"; return 1; }
    # The kernel keeps I/O within the disk: a read at the new end returns nothing.
    got=$(dd if=$DEV bs=4k skip=$((new / 4096)) count=1 iflag=direct 2>/dev/null | wc -c)
    [ "$got" = 0 ] || { DETAIL="$DETAIL; $got bytes read past the new end"; return 1; }
    DETAIL="$DETAIL; data below the new end intact, nothing readable past it"
}
# Ceph RBD (udrive.rbd=1 on the command line): namespace 3 is a clone of a
# protected snapshot the host hot-adds on request; the guest reads the gold data,
# writes, and has the host grow it.
RBD_DEV=/dev/nvme0n3
blk_bytes() { echo $(($(cat /sys/block/$1/size) * 512)); }
t_rbd_clone() {
    echo "UDRIVE-RBD-CLONE" >&4
    i=0
    while [ ! -b $RBD_DEV ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && { DETAIL="no $RBD_DEV 60 s after asking; dmesg: $(dmesg | grep -i nvme | tail -n 2)"; return 1; }
        sleep 0.1
    done
    want=$(yes UDRIVE-RBD-GOLD | head -c $MIB | sha256sum | cut -d' ' -f1)
    got=$(dd if=$RBD_DEV bs=1M count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    DETAIL="$RBD_DEV after $((i / 10)).$((i % 10)) s, $(($(blk_bytes nvme0n3) / MIB)) MiB; first MiB sha256 $(short "$got")... (gold $(short "$want")...)"
    [ "$got" = "$want" ]
}
t_rbd_write() {
    dd if=/dev/urandom of=/tmp/rbdw bs=1M count=1 2>/dev/null
    dd if=/tmp/rbdw of=$RBD_DEV bs=1M seek=2 oflag=direct 2>&1 || return 1
    dd if=$RBD_DEV of=/tmp/rbdr bs=1M skip=2 count=1 iflag=direct 2>&1 || return 1
    cmp /tmp/rbdw /tmp/rbdr || { DETAIL="1 MiB at 2 MiB does not read back"; return 1; }
    sum=$(sha256sum </tmp/rbdw | cut -d' ' -f1)
    echo "UDRIVE-RBD-DATA off=$((2 * MIB)) len=$MIB sha256=$sum" >&4
    DETAIL="1 MiB at 2 MiB written and read back, sha256 $(short "$sum")..."
}
t_rbd_resize() {
    old=$(blk_bytes nvme0n3)
    new=$((old + 64 * MIB))
    echo "UDRIVE-RESIZE nsid=3 bytes=$new shrink=0" >&4
    i=0
    while [ "$(blk_bytes nvme0n3)" != $new ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && { DETAIL="size stayed $(($(blk_bytes nvme0n3) / MIB)) MiB, want $((new / MIB))"; return 1; }
        sleep 0.1
    done
    dd if=$RBD_DEV of=/tmp/rbdr bs=1M skip=2 count=1 iflag=direct 2>&1 || return 1
    cmp /tmp/rbdw /tmp/rbdr || { DETAIL="data changed by the resize"; return 1; }
    DETAIL="$((old / MIB)) -> $((new / MIB)) MiB after $((i / 10)).$((i % 10)) s, data intact"
}
# Encryption (udrive.luks=NSID): that namespace, hot-added on request, is a LUKS2
# volume udrive formatted; fio writes and verifies through it while the host adds
# a key.
LUKS_NSID=$(sed -n 's/.*udrive\.luks=\([0-9]*\).*/\1/p' /proc/cmdline)
LUKS_DEV=/dev/nvme0n${LUKS_NSID:-0}
t_luks() {
    echo "UDRIVE-LUKS-ADD" >&4
    i=0
    while [ ! -b $LUKS_DEV ]; do
        i=$((i + 1))
        if [ $i -gt 600 ]; then
            dmesg | tail -n 12 | sed 's/^/LUKS-DMESG /' >&4
            DETAIL="no $LUKS_DEV 60 s after asking; active namespaces: $(nvme list-ns /dev/nvme0 2>&1 | tr '\n' ' ')"
            return 1
        fi
        sleep 0.1
    done
    fio_run luks --filename=$LUKS_DEV --rw=randwrite --bs=4k --iodepth=16 --size=8M \
        --offset=0 --offset_increment=8M --verify=crc32c --verify_fatal=1 --do_verify=1 &
    fio_pid=$!
    sleep 1
    echo "UDRIVE-LUKS-KEY" >&4
    wait $fio_pid || { DETAIL="fio: $(tail -n 3 /tmp/fio.out | tr '\n' ' ')"; return 1; }
    echo "UDRIVE-LUKS-CHECK" >&4
    DETAIL="$LUKS_DEV ($(($(blk_bytes nvme0n$LUKS_NSID) / MIB)) MiB payload): $(grep -E '^ *WRITE:' /tmp/fio.out | sed 's/^ *//' | cut -c1-60), verified"
}
# qcow2 (udrive.qcow2=NSID): that namespace, hot-added on request, is a qcow2
# overlay over a base image qemu-img filled with copies of the first MiB of
# `yes UDRIVE-QCOW2-BASE`. fio
# writes and verifies in rounds, each with its own seed (a write lost to the
# snapshot or the commit leaves an older round's block, which fails the verify),
# while the host takes a live snapshot and commits it with a pivot; rounds go on
# until the host answered on ttyS1, and one more after that. The guest then sends
# the sha256 of the whole disk, which the host compares with the committed image.
QCOW2_NSID=$(sed -n 's/.*udrive\.qcow2=\([0-9]*\).*/\1/p' /proc/cmdline)
QCOW2_DEV=/dev/nvme0n${QCOW2_NSID:-0}
QCOW2_MIB=32                 # the disk; fio uses 8 MiB per vCPU from 0, the base shows above 16 MiB
t_qcow2() {
    stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null
    exec 3</dev/ttyS1
    : >/tmp/qctl
    cat <&3 >>/tmp/qctl &
    ctl_pid=$!
    echo "UDRIVE-QCOW2-ADD" >&4
    i=0
    while [ ! -b $QCOW2_DEV ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && { DETAIL="no $QCOW2_DEV 60 s after asking"; kill $ctl_pid; return 1; }
        sleep 0.1
    done
    want=$(yes UDRIVE-QCOW2-BASE | head -c $MIB | sha256sum | cut -d' ' -f1)
    for at in $((QCOW2_MIB / 2)) $((QCOW2_MIB - 1)); do
        got=$(dd if=$QCOW2_DEV bs=1M skip=$at count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
        [ "$got" = "$want" ] || { DETAIL="MiB $at of the base reads sha256 $(short "$got")..., qemu-img wrote $(short "$want")..."; kill $ctl_pid; return 1; }
    done
    round=0 after=0
    while [ $after -lt 1 ]; do
        round=$((round + 1))
        [ -s /tmp/qctl ] && after=$((after + 1))
        fio_run qcow2 --filename=$QCOW2_DEV --rw=randwrite --bs=4k --iodepth=16 --size=8M \
            --offset=0 --offset_increment=8M --randseed=$((7000 + round)) \
            --verify=crc32c --verify_fatal=1 --do_verify=1 &
        fio_pid=$!
        [ $round = 1 ] && { sleep 1; echo "UDRIVE-QCOW2-SNAP" >&4; }
        wait $fio_pid || { DETAIL="round $round: fio $(grep -m 2 -iE 'verify|bad|err=' /tmp/fio.out | tr '\n' ' ')"; kill $ctl_pid; return 1; }
        [ $round -lt 30 ] || { DETAIL="no answer from the host after $round rounds"; kill $ctl_pid; return 1; }
    done
    kill $ctl_pid
    sum=$(dd if=$QCOW2_DEV bs=1M iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    echo "UDRIVE-QCOW2-DATA sha256=$sum" >&4
    DETAIL="$round fio write+verify rounds, $after after the host's answer ($(tr -d '\r' </tmp/qctl | tail -n 1 | cut -c1-80)); disk sha256 $(short "$sum")..."
    fail_on_dmesg || { DETAIL="$DETAIL; dmesg has errors"; return 1; }
    tr -d '\r' </tmp/qctl | grep -q '^qcow2 done'
}
t_size_after_reboot() {
    want=$(echo "$MAGIC" | sed -n 's/.*size=\([0-9]*\).*/\1/p')
    DETAIL="size before the reboot $((${want:-0} / MIB)) MiB, now $(($(ns_bytes) / MIB)) MiB"
    [ -n "$want" ] && [ "$(ns_bytes)" = "$want" ]
}
t_write_persist() {
    dd if=/dev/urandom of=/tmp/persist bs=1M count=$PERSIST_MIB 2>/dev/null
    sum=$(sha256sum </tmp/persist | cut -d' ' -f1)
    dd if=/tmp/persist of=$DEV bs=1M seek=$((PERSIST_OFF / MIB)) oflag=direct 2>&1 || return 1
    { echo "UDRIVE-VM-MAGIC phase=1 sha256=$sum size=$(ns_bytes)"; dd if=/dev/zero bs=4k count=1 2>/dev/null; } |
        dd of=$DEV bs=4k count=1 iflag=fullblock seek=$((MAGIC_OFF / 4096)) oflag=direct 2>&1 || return 1
    DETAIL="$PERSIST_MIB MiB at $((PERSIST_OFF / MIB)) MiB, sha256 $(short "$sum")..."
}
read_magic() {
    dd if=$DEV bs=4k count=1 skip=$((MAGIC_OFF / 4096)) iflag=direct 2>/dev/null | head -n1 | tr -d '\0'
}
t_reinit() {
    nvme id-ctrl $CTRL >/tmp/idctrl || return 1
    DETAIL="controller back after warm reboot: $(field mn </tmp/idctrl), $(ls /sys/block/nvme0n1/mq | wc -l) I/O queues;"
    DETAIL="$DETAIL state=$(cat /sys/class/nvme/nvme0/state)"
    [ "$(cat /sys/class/nvme/nvme0/state)" = live ]
}
t_data_persisted() {
    want=$(echo "$MAGIC" | sed -n 's/.*sha256=\([0-9a-f]*\).*/\1/p')
    got=$(dd if=$DEV bs=1M skip=$((PERSIST_OFF / MIB)) count=$PERSIST_MIB iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    DETAIL="sha256 before reboot $(short "$want")..., after $(short "$got")..."
    [ -n "$want" ] && [ "$want" = "$got" ]
}

# ---------------------------------------------------------------- main
# Fd 4 is the console, for markers the host must see while a check's own output
# goes to /tmp/out.
exec 4>&1
wait_for_disk >/tmp/out 2>&1
boot_phase
[ $PHASE = 1 ] && result enumerate PASS "$DETAIL"

if [ $PHASE = 1 ]; then
    run id-ctrl t_id_ctrl
    run id-ns t_id_ns
    run smart-log t_smart_log
    run error-log t_error_log
    run list t_list
    run dbbuf-advertised t_dbbuf_advertised
    run get-features t_features
    run io-queues t_io_queues
    snapshot_irqs
    run fio-randwrite-4k-verify t_fio_4k
    run fio-mixed-1m-verify t_fio_mixed
    run fio-seqread t_fio_seqread
    run queue-irqs-grew t_irqs_grew
    run flush t_flush
    run discard-zeroes t_discard
    run nvme-format t_format
    run resize-grow t_resize_grow
    run resize-shrink t_resize_shrink
    if grep -q 'udrive\.rbd=1' /proc/cmdline; then
        run rbd-clone-hot-added t_rbd_clone
        run rbd-clone-write t_rbd_write
        run rbd-clone-resize t_rbd_resize
    fi
    if [ "${LUKS_NSID:-0}" != 0 ]; then
        run luks-fio-verify t_luks
    fi
    if [ "${QCOW2_NSID:-0}" != 0 ]; then
        run qcow2-fio-verify-snapshot-commit t_qcow2
    fi
    run write-before-reboot t_write_persist
    run dmesg-clean t_dmesg_clean
    finish 1 reboot
elif [ $PHASE = 2 ]; then
    # Mark phase 2 as started, so a third boot knows something went wrong.
    { echo "UDRIVE-VM-MAGIC phase=2"; dd if=/dev/zero bs=4k count=1 2>/dev/null; } >/tmp/magic2
    result enumerate-after-reboot PASS "$DETAIL"
    run reinit t_reinit
    run size-after-reboot t_size_after_reboot
    run data-survived-reboot t_data_persisted
    run fio-verify-after-reboot t_fio_verify_again
    dd if=/tmp/magic2 of=$DEV bs=4k count=1 seek=$((MAGIC_OFF / 4096)) oflag=direct 2>/dev/null
    snapshot_irqs
    run fio-randwrite-after-reboot t_fio_4k
    run queue-irqs-after-reboot t_irqs_grew
    run dmesg-clean-after-reboot t_dmesg_clean
    # Idle with the disk attached, so the host can measure what an idle guest
    # costs udrive (udrive.idle=SECONDS on the kernel command line).
    idle=$(sed -n 's/.*udrive\.idle=\([0-9]*\).*/\1/p' /proc/cmdline)
    if [ -n "$idle" ] && [ "$idle" -gt 0 ]; then
        echo "UDRIVE-IDLE begin secs=$idle"
        sleep "$idle"
        echo "UDRIVE-IDLE end"
    fi
    finish 2 poweroff
else
    result boot-count FAIL "booted a third time (marker: $MAGIC)"
    finish 3 poweroff
fi
