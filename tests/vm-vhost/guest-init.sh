#!/bin/sh
# /init of the vhost-user-blk VM test guest (busybox initramfs, see tests/vm-vhost/README.md).
#
# Boots twice without QEMU exiting:
#   phase 1: loads the stock virtio modules, checks the disk (size, queues,
#            write cache, discard), writes known data from both vCPUs (so both
#            virtqueues carry I/O), reads it back, flushes, (udrive.resize=1) has
#            the host resize the disk, grow then shrink, and follows its size,
#            then lets the host compare the backing file (handshake on ttyS1) and
#            does `reboot -f`.
#   phase 2: checks the size and the data survived the reboot, I/O on both queues again, and
#            (udrive.reconnect=1) keeps writing while the host kills and restarts
#            the backend: every acknowledged write must read back intact.
# Known data: /data/a.bin and /data/b.bin, random files the host put into this
# initramfs and compares with the backing file.
# Output (serial console, parsed by tests/vm-vhost/run.sh):
#   UDRIVE-RESULT name=NAME status=PASS|FAIL detail=TEXT   one per check
#   UDRIVE-BOOT phase=N, UDRIVE-DONE phase=N                progress
#   UDRIVE-HOSTCHECK phase=1                                waits for the host's "go" on ttyS1
#   UDRIVE-RESIZE bytes=B shrink=0|1                        waits for the host's "resized" on ttyS1
#   UDRIVE-RECONNECT-READY / UDRIVE-ACK seq=N off=BYTES sha=SHA256 / UDRIVE-RECONNECT-END
# Parameters on the kernel command line: udrive.queues=N udrive.size=BYTES udrive.reconnect=0|1
# udrive.writers=N udrive.resize=0|1

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
# Keep kernel messages off the console so result lines stay whole; dmesg is
# checked explicitly instead.
echo 1 >/proc/sys/kernel/printk

DEV=/dev/vda
NCPU=$(nproc)
MIB=1048576
arg() { sed -n "s/.*udrive\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
QUEUES=$(arg queues)
SIZE=$(arg size)
RECONNECT=$(arg reconnect)
WRITERS=$(arg writers)
RESIZE=$(arg resize)
# Disk layout (byte offsets; the disk must be >= 256 MiB):
A_OFF=0                     # /data/a.bin, written from vCPU 0 with 1 MiB requests
B_OFF=$((16 * MIB))         # /data/b.bin, written from vCPU 1 with 4 KiB requests
DISCARD_OFF=$((32 * MIB))   # discard test: 4 MiB
RECON_OFF=$((64 * MIB))     # reconnect test: 64 KiB chunks, at most 128 MiB
RECON_MAX=2048
MAGIC_OFF=$((255 * MIB))    # one 4 KiB marker block
DATA_MIB=$(($(wc -c </data/a.bin) / MIB))

# log, result and run: the reporting both VM tests share (packed by initramfs_pack).
# shellcheck source=tests/vm/guest-lib.sh
. /guest-lib.sh
irqs() { # total interrupts of the vector named $1 over all CPUs, -1 if none
    awk -v q="$1" -v n="$NCPU" '$NF == q { s = 0; for (i = 2; i <= n + 1; i++) s += $i; print s; f = 1 }
        END { if (!f) print -1 }' /proc/interrupts
}
vq_name() { echo "$(basename "$(readlink /sys/block/vda/device)")-req.$1"; } # virtioN-req.Q
flushes() { awk '{ print $16 }' /sys/block/vda/stat; } # flush requests completed
finish() { # finish PHASE reboot|poweroff
    sync
    echo "UDRIVE-DONE phase=$1"
    sleep 0.5
    "$2" -f
    sleep 30
}
# wr FILE OFFSET BS CPU / rd OFFSET BYTES BS CPU OUT: direct I/O with dd on one vCPU
wr() { taskset -c "$4" dd if="$1" of=$DEV bs="$3" seek=$(($2 / $3)) oflag=direct conv=notrunc 2>&1; }
rd() { taskset -c "$4" dd if=$DEV of="$5" bs="$3" skip=$(($1 / $3)) count=$(($2 / $3)) iflag=direct 2>&1; }

# ---------------------------------------------------------------- checks
t_modules() {
    for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk; do
        insmod /lib/modules/$m.ko || { DETAIL="insmod $m failed"; return 1; }
    done
    DETAIL="loaded: $(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"
}
t_enumerate() {
    i=0
    while [ ! -b $DEV ]; do
        i=$((i + 1))
        [ $i -gt 300 ] && { DETAIL="no $DEV after 30 s; dmesg: $(dmesg | grep -i virtio | tail -n 3)"; return 1; }
        sleep 0.1
    done
    DETAIL="$DEV after $((i / 10)).$((i % 10)) s"
}
t_geometry() {
    bytes=$(($(cat /sys/block/vda/size) * 512))
    DETAIL="$((bytes / MIB)) MiB (host: $((SIZE / MIB)) MiB), logical block $(cat /sys/block/vda/queue/logical_block_size),"
    DETAIL="$DETAIL max request $(cat /sys/block/vda/queue/max_hw_sectors_kb) KiB, max segments $(cat /sys/block/vda/queue/max_segments),"
    DETAIL="$DETAIL ro=$(cat /sys/block/vda/ro), features $(cat /sys/block/vda/device/features | cut -c1-40)"
    [ "$bytes" = "$SIZE" ] && [ "$(cat /sys/block/vda/ro)" = 0 ]
}
t_queues() {
    nq=$(ls /sys/block/vda/mq | wc -l)
    DETAIL="$nq blk-mq queues for $NCPU vCPUs (device offers $QUEUES);"
    q=0
    while [ $q -lt "$nq" ]; do
        DETAIL="$DETAIL $(vq_name $q): cpus $(cat /sys/block/vda/mq/$q/cpu_list) irqs=$(irqs "$(vq_name $q)");"
        [ "$(irqs "$(vq_name $q)")" -ge 0 ] || return 1
        q=$((q + 1))
    done
    grep virtio /proc/interrupts
    [ "$nq" = "$QUEUES" ]
}
snapshot_irqs() {
    q=0
    while [ $q -lt "$QUEUES" ]; do
        eval "IRQ_BEFORE_$q=$(irqs "$(vq_name $q)")"
        q=$((q + 1))
    done
}
t_irqs_grew() {
    ok=0 q=0
    while [ $q -lt "$QUEUES" ]; do
        eval "before=\$IRQ_BEFORE_$q"
        now=$(irqs "$(vq_name $q)")
        DETAIL="$DETAIL $(vq_name $q): $before -> $now;"
        [ "$now" -gt "$before" ] || ok=1
        q=$((q + 1))
    done
    grep virtio /proc/interrupts
    return $ok
}
t_write_read() {
    # Both vCPUs at once: a.bin in 1 MiB requests from vCPU 0, b.bin in 4 KiB
    # requests from vCPU 1; read back crosswise (other vCPU, other request size).
    wr /data/a.bin $A_OFF 1048576 0 >/tmp/wa &
    pa=$!
    wr /data/b.bin $B_OFF 4096 1 >/tmp/wb || { cat /tmp/wb; return 1; }
    wait $pa || { cat /tmp/wa; return 1; }
    rd $A_OFF $((DATA_MIB * MIB)) 4096 1 /tmp/a.back &&
        rd $B_OFF $((DATA_MIB * MIB)) 1048576 0 /tmp/b.back || return 1
    DETAIL="2 x $DATA_MIB MiB written (1 MiB and 4 KiB requests, one per vCPU), read back"
    cmp /data/a.bin /tmp/a.back && cmp /data/b.bin /tmp/b.back || { DETAIL="$DETAIL: MISMATCH"; return 1; }
    DETAIL="$DETAIL: identical"
    rm -f /tmp/a.back /tmp/b.back
}
t_flush() {
    wc=$(cat /sys/block/vda/queue/write_cache)
    # A device that starts write-through (qemu-storage-daemon does) is switched to
    # write-back through the config space's wce byte (VIRTIO_BLK_F_CONFIG_WCE), so
    # that flushes are sent at all.
    if [ "$wc" != "write back" ]; then
        echo "write back" >/sys/block/vda/cache_type || { DETAIL="write_cache='$wc', cannot switch to write back"; return 1; }
        wc="$wc, switched to '$(cat /sys/block/vda/queue/write_cache)'"
    fi
    before=$(flushes)
    # fsync on the block device sends a flush when the write cache is on.
    taskset -c 0 dd if=/data/a.bin of=$DEV bs=4096 count=1 seek=$((A_OFF / 4096)) conv=fsync,notrunc 2>&1 || return 1
    taskset -c 1 dd if=/data/b.bin of=$DEV bs=4096 count=1 seek=$((B_OFF / 4096)) conv=fsync,notrunc 2>&1 || return 1
    after=$(flushes)
    DETAIL="write_cache='$wc', flush requests $before -> $after"
    [ "$(cat /sys/block/vda/queue/write_cache)" = "write back" ] && [ "$after" -gt "$before" ]
}
t_discard() {
    max=$(cat /sys/block/vda/queue/discard_max_bytes)
    DETAIL="discard_max_bytes=$max"
    [ "$max" -gt 0 ] || return 1
    dd if=/dev/urandom of=/tmp/pattern bs=1M count=4 2>/dev/null
    dd if=/tmp/pattern of=$DEV bs=1M seek=$((DISCARD_OFF / MIB)) oflag=direct conv=notrunc 2>&1 || return 1
    # Discard the middle 2 MiB; the first and last MiB must survive.
    blkdiscard -o $((DISCARD_OFF + MIB)) -l $((2 * MIB)) $DEV || { DETAIL="$DETAIL; blkdiscard failed"; return 1; }
    dd if=$DEV of=/tmp/back bs=1M skip=$((DISCARD_OFF / MIB)) count=4 iflag=direct 2>&1 || return 1
    for m in 0 3; do
        dd if=/tmp/pattern bs=1M skip=$m count=1 2>/dev/null >/tmp/x
        dd if=/tmp/back bs=1M skip=$m count=1 2>/dev/null | cmp - /tmp/x ||
            { DETAIL="$DETAIL; data next to the discarded range changed"; return 1; }
    done
    # virtio does not promise zeroes after a discard: reported, not required.
    dd if=/dev/zero of=/tmp/zero bs=1M count=2 2>/dev/null
    if dd if=/tmp/back bs=1M skip=1 count=2 2>/dev/null | cmp -s - /tmp/zero; then z=zeroes; else z="old or other data"; fi
    DETAIL="$DETAIL; 2 MiB discarded (reads back $z), neighbours intact"
    rm -f /tmp/pattern /tmp/back /tmp/x /tmp/zero
}
# Online resize (docs/decisions/0018-online-resize.md): the host resizes the disk
# over udrive's control socket; udrive tells QEMU (config change message), QEMU
# injects a config interrupt and virtio_blk updates the disk's size.
disk_bytes() { echo $(($(cat /sys/block/vda/size) * 512)); }
wait_size() { # wait_size BYTES: until the kernel shows that size (60 s at most)
    i=0
    while [ "$(disk_bytes)" != "$1" ]; do
        i=$((i + 1))
        [ $i -gt 600 ] && return 1
        sleep 0.1
    done
    WAITED="$((i / 10)).$((i % 10)) s"
}
ask_resize() { # ask_resize BYTES SHRINK: the host's answer in $REPLY_LINE
    echo "UDRIVE-RESIZE bytes=$1 shrink=$2" >&4
    read -r -t 120 REPLY_LINE <&3 || { REPLY_LINE="no reply from the host on ttyS1 in 120 s"; return 1; }
    case "$REPLY_LINE" in resized*) ;; *) return 1 ;; esac
}
t_resize_grow() {
    old=$(disk_bytes)
    new=$((old + 64 * MIB))
    DETAIL="$((old / MIB)) MiB"
    dd if=/dev/urandom of=/tmp/edge bs=4k count=1 2>/dev/null
    wr /tmp/edge $((old - 4096)) 4096 0 || return 1
    ask_resize $new 0 || { DETAIL="$DETAIL; host: $REPLY_LINE"; return 1; }
    wait_size $new || { DETAIL="$DETAIL; size stayed $(($(disk_bytes) / MIB)) MiB, want $((new / MIB))"; return 1; }
    DETAIL="$DETAIL -> $((new / MIB)) MiB after $WAITED"
    # 1 MiB past the old end from vCPU 1, read back from vCPU 0.
    dd if=/dev/urandom of=/tmp/grown bs=1M count=1 2>/dev/null
    wr /tmp/grown "$old" 1048576 1 || return 1
    rd "$old" $MIB 65536 0 /tmp/back || return 1
    cmp /tmp/grown /tmp/back || { DETAIL="$DETAIL; the new space does not read back"; return 1; }
    rd $((old - 4096)) 4096 4096 1 /tmp/back || return 1
    cmp /tmp/edge /tmp/back || { DETAIL="$DETAIL; the block before the old end changed"; return 1; }
    DETAIL="$DETAIL; 1 MiB past the old end reads back, the block before it intact"
    GROWN_AT=$old
}
t_resize_shrink() {
    old=$(disk_bytes)
    new=$((old - 32 * MIB))
    DETAIL="$((old / MIB)) MiB"
    ask_resize $new 1 || { DETAIL="$DETAIL; host: $REPLY_LINE"; return 1; }
    wait_size $new || { DETAIL="$DETAIL; size stayed $(($(disk_bytes) / MIB)) MiB, want $((new / MIB))"; return 1; }
    DETAIL="$DETAIL -> $((new / MIB)) MiB after $WAITED"
    rd "$GROWN_AT" $MIB 65536 1 /tmp/back || return 1
    cmp /tmp/grown /tmp/back || { DETAIL="$DETAIL; data below the new end changed"; return 1; }
    got=$(dd if=$DEV bs=4k skip=$((new / 4096)) count=1 iflag=direct 2>/dev/null | wc -c)
    [ "$got" = 0 ] || { DETAIL="$DETAIL; $got bytes read past the new end"; return 1; }
    DETAIL="$DETAIL; data below the new end intact, nothing readable past it"
}
t_size_after_reboot() {
    want=$(echo "$MAGIC" | sed -n 's/.*size=\([0-9]*\).*/\1/p')
    DETAIL="size before the reboot $((${want:-0} / MIB)) MiB, now $(($(disk_bytes) / MIB)) MiB"
    [ -n "$want" ] && [ "$(disk_bytes)" = "$want" ]
}
t_dmesg_clean() {
    DETAIL="$(dmesg | grep -c virtio) virtio lines in dmesg, none with errors"
    ! dmesg | grep -iE 'virtio.*(error|fail|timeout|reset)|I/O error|Buffer I/O|blk_update_request|critical'
}
t_write_marker() {
    sum=$(cat /data/a.bin /data/b.bin | sha256sum | cut -d' ' -f1)
    { echo "UDRIVE-VM-MAGIC phase=1 sha256=$sum size=$(disk_bytes)"; dd if=/dev/zero bs=4k count=1 2>/dev/null; } |
        dd of=$DEV bs=4k count=1 iflag=fullblock seek=$((MAGIC_OFF / 4096)) oflag=direct conv=fsync,notrunc 2>&1 || return 1
    DETAIL="marker at $((MAGIC_OFF / MIB)) MiB"
}
read_magic() {
    dd if=$DEV bs=4k count=1 skip=$((MAGIC_OFF / 4096)) iflag=direct 2>/dev/null | head -n1 | tr -d '\0'
}
t_host_check() { # the host compares its backing file while the device is live
    echo "UDRIVE-HOSTCHECK phase=1" >&4
    read -r -t 120 reply <&3 || { DETAIL="no reply from the host on ttyS1 in 120 s"; return 1; }
    DETAIL="host: $reply"
    case "$reply" in go*) ;; *) return 1 ;; esac
}
t_data_survived() {
    rd $A_OFF $((DATA_MIB * MIB)) 1048576 1 /tmp/a.back && rd $B_OFF $((DATA_MIB * MIB)) 1048576 0 /tmp/b.back || return 1
    DETAIL="a.bin and b.bin after the reboot:"
    cmp /data/a.bin /tmp/a.back && cmp /data/b.bin /tmp/b.back || { DETAIL="$DETAIL MISMATCH"; return 1; }
    DETAIL="$DETAIL identical"
    rm -f /tmp/a.back /tmp/b.back
}
t_reread_both_queues() {
    rd $B_OFF $((DATA_MIB * MIB)) 65536 0 /tmp/b.back && rd $A_OFF $((DATA_MIB * MIB)) 65536 1 /tmp/a.back || return 1
    cmp /data/a.bin /tmp/a.back && cmp /data/b.bin /tmp/b.back || { DETAIL="MISMATCH"; return 1; }
    DETAIL="64 KiB reads from both vCPUs, identical"
    rm -f /tmp/a.back /tmp/b.back
}

# Reconnect: WRITERS processes on vCPU 0 (so several requests are in flight on
# queue 0 and may complete out of order) each write fresh random 64 KiB chunks one
# after another, each with O_DIRECT + fsync, and print each acknowledged one (seq,
# offset, sha256); vCPU 1 keeps reading and checking a.bin. The host kills the
# backend after a few chunks, restarts it and says "restarted" on ttyS1; each writer
# then does 32 more chunks. Afterwards every acknowledged chunk must read back with
# its sha256.
recon_writer() { # recon_writer W: chunks W, W+WRITERS, W+2*WRITERS, ...
    w=$1 i=$1 left=-1
    while [ $i -lt $RECON_MAX ] && [ $left != 0 ]; do
        dd if=/dev/urandom of=/tmp/chunk.$w bs=65536 count=1 2>/dev/null
        sum=$(sha256sum </tmp/chunk.$w | cut -d' ' -f1)
        off=$((RECON_OFF + i * 65536))
        if taskset -c 0 dd if=/tmp/chunk.$w of=$DEV bs=65536 seek=$((off / 65536)) oflag=direct conv=fsync,notrunc 2>/tmp/wr.err.$w; then
            echo "$i $off $sum" >>/tmp/acks.$w
            echo "UDRIVE-ACK seq=$i off=$off sha=$sum" >&4
        else
            echo "UDRIVE-NACK seq=$i off=$off $(tr '\n' ' ' </tmp/wr.err.$w)" >&4
            echo "$i $off error" >>/tmp/acks.$w
        fi
        i=$((i + WRITERS))
        if [ $left = -1 ] && [ -f /tmp/restarted ]; then left=32; fi
        [ $left -gt 0 ] && left=$((left - 1))
    done
}
recon_reader() {
    n=0 bad=0
    while [ ! -f /tmp/writer-done ]; do
        rd $A_OFF $((DATA_MIB * MIB)) 65536 1 /tmp/a.rd >/dev/null || bad=$((bad + 1))
        cmp -s /data/a.bin /tmp/a.rd || bad=$((bad + 1))
        n=$((n + 1))
    done
    echo "$n $bad" >/tmp/reader
}
t_reconnect() {
    rm -f /tmp/restarted /tmp/writer-done /tmp/reader /tmp/acks.*
    recon_reader &
    rpid=$!
    echo "UDRIVE-RECONNECT-READY writers=$WRITERS" >&4
    wpids=
    w=0
    while [ $w -lt "$WRITERS" ]; do
        : >/tmp/acks.$w
        recon_writer $w &
        wpids="$wpids $!"
        w=$((w + 1))
    done
    if read -r -t 240 reply <&3; then
        DETAIL="host: $reply;"
    else
        DETAIL="no word from the host on ttyS1 in 240 s;"
    fi
    touch /tmp/restarted
    # shellcheck disable=SC2086
    wait $wpids
    touch /tmp/writer-done
    wait $rpid
    echo "UDRIVE-RECONNECT-END" >&4
    cat /tmp/acks.* >/tmp/acks
    acked=$(grep -vc error /tmp/acks) errs=$(grep -c error /tmp/acks)
    # Every acknowledged chunk must read back as written.
    lost=0
    while read -r seq off sum; do
        [ "$sum" = error ] && continue
        got=$(dd if=$DEV bs=65536 skip=$((off / 65536)) count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
        [ "$got" = "$sum" ] || { lost=$((lost + 1)); echo "chunk $seq at $off: want $sum got $got"; }
    done </tmp/acks
    read -r rn rbad </tmp/reader
    DETAIL="$DETAIL $WRITERS writers: $acked chunks acknowledged, $errs write errors, $lost acknowledged chunks wrong; reader: $rn passes, $rbad bad"
    case "$reply" in restarted*) ;; *) return 1 ;; esac
    [ "$lost" = 0 ] && [ "$errs" = 0 ] && [ "$rbad" = 0 ] && [ "$acked" -gt $((32 * WRITERS)) ]
}

# ---------------------------------------------------------------- main
# The host talks to the guest on ttyS1 (a QEMU pipe chardev); kept open all along
# so nothing it sends is dropped. Fd 4 is the console, for markers the host
# must see while a check's own output goes to /tmp/out.
stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null
exec 3</dev/ttyS1 4>&1
run modules t_modules
t_enumerate >/tmp/out 2>&1
boot_phase

if [ $PHASE = 1 ]; then
    result enumerate PASS "$DETAIL"
    run geometry t_geometry
    run queues t_queues
    snapshot_irqs
    run write-read-verify t_write_read
    run queue-irqs-grew t_irqs_grew
    run flush t_flush
    run discard t_discard
    if [ "$RESIZE" = 1 ]; then
        run resize-grow t_resize_grow
        run resize-shrink t_resize_shrink
    fi
    run write-marker t_write_marker
    run dmesg-clean t_dmesg_clean
    run host-check-handshake t_host_check
    finish 1 reboot
elif [ $PHASE = 2 ]; then
    { echo "UDRIVE-VM-MAGIC phase=2"; dd if=/dev/zero bs=4k count=1 2>/dev/null; } >/tmp/magic2
    result enumerate-after-reboot PASS "$DETAIL"
    run size-after-reboot t_size_after_reboot
    run data-survived-reboot t_data_survived
    dd if=/tmp/magic2 of=$DEV bs=4k count=1 seek=$((MAGIC_OFF / 4096)) oflag=direct conv=fsync,notrunc 2>/dev/null
    run queues-after-reboot t_queues
    snapshot_irqs
    run reread-both-queues t_reread_both_queues
    run queue-irqs-after-reboot t_irqs_grew
    [ "$RECONNECT" = 1 ] && run reconnect t_reconnect
    run dmesg-clean-after-reboot t_dmesg_clean
    finish 2 poweroff
else
    result boot-count FAIL "booted a third time (marker: $MAGIC)"
    finish 3 poweroff
fi
