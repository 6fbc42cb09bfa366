# Reporting helpers for the guests' /init scripts (sourced; busybox sh). The host
# side reads the UDRIVE-RESULT lines from the console.

log() { echo "udrive-guest: $*"; }
# guest_mounts: /proc, /sys, /dev and a tmpfs /tmp; kernel messages off the console
# so result lines stay whole.
guest_mounts() {
    mount -t proc proc /proc
    mount -t sysfs sysfs /sys
    mount -t devtmpfs devtmpfs /dev 2>/dev/null
    mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
    echo 1 >/proc/sys/kernel/printk
}
# result NAME PASS|FAIL DETAIL...  (detail is one line, no newlines)
result() {
    n=$1 s=$2
    shift 2
    echo "UDRIVE-RESULT name=$n status=$s detail=$(echo "$*" | tr '\n' ' ' | cut -c1-300)"
}
# run NAME FUNC: FUNC sets $DETAIL and returns 0 for PASS; its output is
# shown (indented) only on failure.
run() {
    name=$1
    DETAIL=
    if "$2" >/tmp/out 2>&1; then
        result "$name" PASS "$DETAIL"
    else
        sed 's/^/    | /' /tmp/out | tail -n 40
        result "$name" FAIL "$DETAIL"
    fi
}

# boot_phase: once the disk should be there ($DEV; the caller's wait set $DETAIL):
# reports enumerate FAIL and powers off if it is not, else reads the caller's magic
# block (read_magic) and sets MAGIC and PHASE (1 first boot, 2 after the warm
# reboot, 3 after that) and prints the UDRIVE-BOOT line the host watches for.
boot_phase() {
    if [ ! -b "$DEV" ]; then
        result enumerate FAIL "$DETAIL"
        dmesg | tail -n 40
        finish 0 poweroff
    fi
    MAGIC=$(read_magic)
    case "$MAGIC" in
    UDRIVE-VM-MAGIC\ phase=1*) PHASE=2 ;;
    UDRIVE-VM-MAGIC*) PHASE=3 ;;
    *) PHASE=1 ;;
    esac
    echo "UDRIVE-BOOT phase=$PHASE cpus=$NCPU kernel=$(uname -r) uptime=$(cut -d' ' -f1 /proc/uptime)s"
}
