#!/bin/sh
# /init of the live-migration VM test guest (busybox initramfs, see
# tests/vm-migrate/README.md): loads the stock virtio modules, runs migcheck on
# /dev/vda until the host says "stop" on ttyS1 (the QEMU the guest runs on by
# then), reports the final check and powers off.
# Output (serial console, parsed by tests/vm-migrate/run.sh):
#   MIGCHECK ...                                           migcheck's own lines
#   UDRIVE-RESULT name=NAME status=PASS|FAIL detail=TEXT   one per check
#   UDRIVE-DONE                                            before the power-off
# Parameters on the kernel command line: udrive.mib=N (the region migcheck checks)

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
# shellcheck source=tests/vm/guest-lib.sh
. /guest-lib.sh
guest_mounts
MIB=$(sed -n 's/.*udrive\.mib=\([^ ]*\).*/\1/p' /proc/cmdline)

for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk; do
    insmod /lib/modules/$m.ko || result modules FAIL "insmod $m failed"
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
if [ ! -b /dev/vda ]; then
    result enumerate FAIL "no /dev/vda"
    echo "UDRIVE-DONE"
    poweroff -f
fi
stty -F /dev/ttyS1 -echo -icrnl 2>/dev/null
exec 3</dev/ttyS1
/bin/migcheck run /dev/vda "$MIB" &
pid=$!
# Waits for the host's word; a migration moves the serial port, so this read
# continues on the destination's ttyS1.
read -r word <&3 || word="no word"
log "host: $word"
kill -USR1 "$pid"
wait "$pid"
rc=$?
if [ "$rc" = 0 ]; then
    result guest-migcheck PASS "every pass and the final full check matched"
else
    result guest-migcheck FAIL "migcheck exited $rc (mismatches: see the MIGCHECK lines)"
fi
sync
echo "UDRIVE-DONE"
sleep 0.5
poweroff -f
