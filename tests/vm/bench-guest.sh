#!/bin/sh
# /init of the `udrive bench` VM guest (busybox initramfs made by scripts/vm-bench):
# runs every fio job of /bench-jobs (one line of fio options each, written by the
# harness) on the disk udrive.dev= names, prints each job's JSON between marker
# lines on the serial console, and powers off:
#   UDRIVE-BENCH-BOOT dev=DEV cpus=N uptime=S   the disk is there
#   UDRIVE-FIO-BEGIN n=K / UDRIVE-FIO-END n=K rc=RC   around job K's JSON
#   UDRIVE-BENCH-DONE                             every job ran
# A virtio disk needs the stock modules (/lib/modules/*.ko, udrive.modules= lists
# them in load order); NVMe is built into the kernel.

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
# shellcheck source=tests/vm/guest-lib.sh
. /guest-lib.sh
guest_mounts

arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^udrive\.$1=//p" | head -n1; }
DEV=/dev/$(arg dev)
for m in $(arg modules | tr ',' ' '); do
    insmod "/lib/modules/$m.ko" || log "insmod $m failed"
done
i=0
while [ ! -b "$DEV" ]; do
    i=$((i + 1))
    if [ $i -gt 300 ]; then
        echo "UDRIVE-BENCH-FAIL no $DEV after 30 s: $(dmesg | grep -iE 'nvme|virtio' | tail -n 3 | tr '\n' ' ')"
        poweroff -f
    fi
    sleep 0.1
done
echo "UDRIVE-BENCH-BOOT dev=$DEV cpus=$(nproc) uptime=$(cut -d' ' -f1 /proc/uptime)"

# io_uring where fio and the kernel have it, else libaio.
ENGINE=io_uring
fio --name=probe --filename="$DEV" --ioengine=io_uring --direct=1 --rw=read --bs=4k --size=4k \
    --output=/tmp/probe >/dev/null 2>&1 || ENGINE=libaio

n=0
while read -r job; do
    [ -n "$job" ] || continue
    n=$((n + 1))
    # shellcheck disable=SC2086 # a line of fio options
    fio --name=bench --filename="$DEV" --ioengine=$ENGINE --direct=1 --time_based \
        --group_reporting --lat_percentiles=1 --percentile_list=50:99:99.9:99.99 \
        --output-format=json --output=/tmp/fio.json $job >/tmp/fio.err 2>&1
    rc=$?
    echo "UDRIVE-FIO-BEGIN n=$n engine=$ENGINE"
    [ $rc = 0 ] && cat /tmp/fio.json
    [ $rc = 0 ] || sed 's/^/fio: /' /tmp/fio.err | tail -n 5
    echo "UDRIVE-FIO-END n=$n rc=$rc"
done </bench-jobs
echo "UDRIVE-BENCH-DONE jobs=$n"
sync
sleep 0.5
poweroff -f
sleep 30
