# shellcheck shell=bash
# Sourced by tests/package/run.sh once the package's udrive.service runs in the
# container ($init, in_box): libvirtd defines and starts the domain of
# dist/libvirt/vm-vhost-user-blk.xml (made TCG, with a direct kernel boot and
# serial files, its disk part untouched) on a disk the service serves. The guest
# (tests/vm/guest-upgrade.sh) runs fio with crc32c verify and twice asks the host
# to act while its writes are in flight: first `systemctl restart udrive` (QEMU
# reconnects and resubmits what was in flight), then a live `udrive upgrade`. Its
# UDRIVE-RESULT lines count as checks.

LIBVIRT_PKGS=libvirt-daemon-system,libvirt-clients,qemu-system-x86
VM_NAME=vm1
VM_SOCKET=/run/udrive/vm1-disk.sock

# The domain as the repository ships it, made runnable here: TCG, 384 MiB, one
# vCPU, the test's kernel and initramfs, serial 0 to a file and serial 1 to the
# host's pipe. Disk, memory backing and reconnect stay as shipped.
libvirt_domain_xml() {
    python3 - "$root/dist/libvirt/vm-vhost-user-blk.xml" /pkg "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET
src, d, job_mib = sys.argv[1], sys.argv[2], sys.argv[3]
dom = ET.parse(src).getroot()
dom.set("type", "qemu")
dom.find("memory").text = "384"
dom.find("vcpu").text = "1"
os_ = dom.find("os")
for b in os_.findall("boot"):
    os_.remove(b)
ET.SubElement(os_, "loader", {"type": "rom"}).text = "/usr/share/qemu/qboot.rom"
ET.SubElement(os_, "kernel").text = f"{d}/vmlinuz"
ET.SubElement(os_, "initrd").text = f"{d}/initramfs.cpio"
ET.SubElement(os_, "cmdline").text = (
    "console=ttyS0 quiet edd=off panic=-1 rdinit=/init "
    f"udrive.dev=vda udrive.upgrades=2 udrive.job_mib={job_mib}")
devs = dom.find("devices")
for tag in ("serial", "console"):
    for e in devs.findall(tag):
        devs.remove(e)
s0 = ET.SubElement(devs, "serial", {"type": "file"})
ET.SubElement(s0, "source", {"path": f"{d}/console.log"})
ET.SubElement(s0, "target", {"port": "0"})
s1 = ET.SubElement(devs, "serial", {"type": "pipe"})
ET.SubElement(s1, "source", {"path": f"{d}/ctl"})
ET.SubElement(s1, "target", {"port": "1"})
ET.SubElement(devs, "memballoon", {"model": "none"})
ET.ElementTree(dom).write(sys.stdout, encoding="unicode")
PY
}

libvirt_initramfs() {
    local r=$TMP/initramfs
    [ -x "$CACHE/sid/usr/bin/fio" ] ||
        die "no fio in $CACHE/sid: run scripts/vm-test once first (its sid chroot has fio)"
    ensure_kernel
    initramfs_begin "$r" "$CACHE/sid/bin/busybox"
    mkdir -p "$r/lib/modules"
    cp "$TMP"/modules/*.ko "$r/lib/modules/"
    initramfs_add_bin "$r" "$CACHE/sid" /usr/bin/fio
    initramfs_pack "$r" "$root/tests/vm/guest-upgrade.sh" "$TMP/initramfs.cpio"
}

# On the guest's UDRIVE-UPGRADE n=N: a restart of the unit, then a live upgrade.
LIBVIRT_ACTS=0
libvirt_hook() {
    [[ ${1:-} =~ ^UDRIVE-UPGRADE\ n=([0-9]+) ]] || return 0
    LIBVIRT_ACTS=$((LIBVIRT_ACTS + 1))
    local t0=$EPOCHREALTIME out
    if [ "$LIBVIRT_ACTS" = 1 ]; then
        if out=$(in_box systemctl restart udrive 2>&1); then
            tell_guest "upgraded n=1: systemctl restart udrive in $(elapsed "$t0") s (QEMU reconnects)"
        else
            tell_guest "failed n=1: systemctl restart udrive: $out"
        fi
    elif out=$(in_box udrive upgrade --rpc /run/udrive/rpc.sock 2>&1); then
        tell_guest "upgraded n=$LIBVIRT_ACTS: udrive upgrade in $(elapsed "$t0") s"
    else
        tell_guest "failed n=$LIBVIRT_ACTS: $(tr '\n' ' ' <<<"$out" | cut -c1-200)"
    fi
}

libvirt_test() {
    phase "libvirt: TCG guest on a udrive disk, fio verify across a restart and an upgrade"
    libvirt_initramfs
    chmod 755 "$TMP"
    : >"$TMP/console.log"
    mkfifo "$TMP/ctl.in" "$TMP/ctl.out"
    chmod 666 "$TMP/console.log" "$TMP/ctl.in" "$TMP/ctl.out"
    in_box sh -c 'truncate -s 512M /var/lib/udrive/vm1.img && chown udrive: /var/lib/udrive/vm1.img'
    in_box sh -c "cat >>/etc/udrive/udrive.toml" <<TOML

[[vhost_user_blk]]
socket = "$VM_SOCKET"
disk = "file:/var/lib/udrive/vm1.img"
queues = 2
TOML
    check "reload: the VM's disk is served" in_box systemctl reload udrive
    # The helper prints the disk element the shipped domain (run below) has.
    in_box udrive libvirt-xml --rpc /run/udrive/rpc.sock "$VM_SOCKET" >"$TMP/disk.xml" 2>&1
    check "udrive libvirt-xml prints the shipped domain's disk" python3 - "$TMP/disk.xml" "$root/dist/libvirt/vm-vhost-user-blk.xml" <<'PY'
import re, sys
def disk(path):
    m = re.search(r"<disk type='vhostuser'.*?</disk>", open(path).read(), re.S)
    return re.sub(r"\s+", " ", m.group(0)) if m else None
got, want = disk(sys.argv[1]), disk(sys.argv[2])
sys.exit(0 if got and got == want else f"printed {got!r}, shipped {want!r}")
PY
    # A container: no namespaces, cgroups or security driver for QEMU, and files
    # stay as they are (the run directory is shared with the host).
    in_box sh -c 'cat >>/etc/libvirt/qemu.conf' <<'CONF'
namespaces = []
cgroup_controllers = []
security_driver = "none"
dynamic_ownership = 0
CONF
    check "libvirtd runs" in_box systemctl restart libvirtd
    # fio MiB for the guest: enough to still be writing at the second upgrade when
    # the TCG guest runs fast (about 30 MiB/s); the disk above is larger still.
    libvirt_domain_xml 448 >"$TMP/vm1.xml"
    # This host has no KVM for libvirt to offer; the rest of the domain as shipped.
    sed "s/<domain type='kvm'/<domain type='qemu'/" "$root/dist/libvirt/vm-nvme-vfio-user.xml" >"$TMP/vm2.xml"
    check "virsh define (the shipped vhost-user-blk domain)" in_box virsh -q define /pkg/vm1.xml
    check "virsh define (the shipped NVMe domain)" in_box virsh -q define /pkg/vm2.xml
    in_box virsh -q undefine vm2 >/dev/null 2>&1
    check "virsh start" in_box virsh -q start "$VM_NAME"
    # watch_guest follows QEMU_PID: here a waiter that ends with the domain.
    (while in_box virsh -q domstate "$VM_NAME" 2>/dev/null | grep -q running; do sleep 1; done) &
    QEMU_PID=$!
    watch_guest "$TMP/console.log" 900 libvirt_hook
    guest_results "$TMP/console.log"
    local l
    for l in "${RESULTS[@]}"; do
        [[ $l =~ name=([^ ]*)\ status=([A-Z]*)\ detail=(.*) ]] || continue
        if [ "${BASH_REMATCH[2]}" = PASS ]; then ok "guest: ${BASH_REMATCH[1]}: ${BASH_REMATCH[3]:0:160}"; else bad "guest: ${BASH_REMATCH[1]}: ${BASH_REMATCH[3]}"; fi
    done
    RESULTS=()
    grep -aq '^UDRIVE-DONE phase=1' "$TMP/console.log" && ok "guest finished" ||
        bad "guest did not finish: $(grep -aE '^UDRIVE-' "$TMP/console.log" | tail -n 2 | tr '\n' ' ') ${HARNESS_FAIL[*]}"
    [ "$LIBVIRT_ACTS" = 2 ] && ok "restart and upgrade done under the guest's I/O" || bad "the guest asked $LIBVIRT_ACTS times, want 2"
    in_box virsh -q destroy "$VM_NAME" >/dev/null 2>&1
    check "virsh undefine" in_box virsh -q undefine "$VM_NAME"
}
