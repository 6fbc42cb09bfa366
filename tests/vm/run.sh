#!/usr/bin/env bash
# udrive VM test: boots a Linux guest under QEMU (TCG) on an NVMe controller served
# by `udrive serve` over vfio-user, and checks what the guest reports.
# Entry point: scripts/vm-test. Settings (environment) are listed in tests/vm/README.md.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/vm

CACHE=${UDRIVE_VM_CACHE:-/var/cache/udrive-vm}
SID=$CACHE/sid
SID_PKGS=qemu-system-x86,busybox-static,nvme-cli,fio
NS=${UDRIVE_VM_NS:-ram:1G}
UDRIVE_CPUS=${UDRIVE_VM_UDRIVE_CPUS:-0}
VCPUS=${UDRIVE_VM_VCPUS:-2}
TIMEOUT=${UDRIVE_VM_TIMEOUT:-480}
GUEST_INIT=${UDRIVE_VM_GUEST_INIT:-$here/guest-init.sh}
# udrive (default) or qemu-nvme: QEMU's own emulated NVMe instead of udrive, to
# check the harness and guest script themselves (udrive-specific checks then fail).
DEVICE=${UDRIVE_VM_DEVICE:-udrive}
IN_CHROOT=/run/udrive-vm # where the run directory appears inside the chroot

T0=$EPOCHREALTIME
say() { printf 'vm-test: %s\n' "$*"; }
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
PHASE='' PHASE_T='' TIMES=()
phase() { # phase NAME: ends the previous phase (printing its time) and starts NAME
    if [ -n "$PHASE" ]; then
        local t
        t=$(elapsed "$PHASE_T")
        say "-- $PHASE: ${t} s"
        TIMES+=("$(printf '%-28s %6s s' "$PHASE" "$t")")
    fi
    PHASE=$1 PHASE_T=$EPOCHREALTIME
    [ -z "$PHASE" ] || say "== $PHASE"
}
# Infrastructure problems (no QEMU, no kernel, no udrive) fail the run, never skip it.
die() {
    say "FAIL: $*"
    echo "0 passed, 1 failed"
    exit 1
}

if [ "${UDRIVE_VM_TESTS:-1}" = 0 ]; then
    say "skipped (UDRIVE_VM_TESTS=0)"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts); run with sudo, or set UDRIVE_VM_TESTS=0 to skip"

# ------------------------------------------------------------ cleanup
TMP=$(mktemp -d /tmp/udrive-vm.XXXXXX)
QEMU_PID='' UDRIVE_PID=''
cleanup() {
    set +e
    [ -n "$QEMU_PID" ] && kill -KILL "$QEMU_PID" 2>/dev/null && wait "$QEMU_PID" 2>/dev/null
    [ -n "$UDRIVE_PID" ] && kill -KILL "$UDRIVE_PID" 2>/dev/null && wait "$UDRIVE_PID" 2>/dev/null
    # QEMU's bind mounts live in its own mount namespace and vanish with it;
    # this only catches a namespace-less leftover.
    mountpoint -q "$SID$IN_CHROOT" 2>/dev/null && umount -l "$SID$IN_CHROOT"
    if [ "${UDRIVE_VM_KEEP:-0}" = 1 ]; then say "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ------------------------------------------------------------ host tools, sid chroot
mirror() { # the Debian mirror this machine's apt uses
    [ -n "${UDRIVE_VM_MIRROR:-}" ] && { echo "$UDRIVE_VM_MIRROR"; return; }
    local m
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v '^\s*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')
    echo "${m:-http://deb.debian.org/debian}"
}

ensure_chroot() {
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap (apt-get) ..."
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null ||
            die "cannot install debootstrap with apt-get"
    fi
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9 # one setup at a time; parallel runs then share the cache
    if [ "$(cat "$SID/.udrive-vm-ready" 2>/dev/null)" != "$SID_PKGS" ]; then
        if [ -f "$SID/.udrive-vm-ready" ]; then
            say "adding ${SID_PKGS//,/ } to $SID (apt-get in the chroot) ..."
            cp /etc/resolv.conf "$SID/etc/resolv.conf" 2>/dev/null || true
            unshare --mount --propagation private -- sh -c 'mount -t proc proc "$1/proc" &&
                DEBIAN_FRONTEND=noninteractive chroot "$1" sh -c "apt-get -o Acquire::Check-Valid-Until=false update -qq && apt-get install -y -qq --no-install-recommends $2"' \
                - "$SID" "${SID_PKGS//,/ }" >"$CACHE/apt.log" 2>&1 ||
                { tail -n 20 "$CACHE/apt.log"; die "apt-get in $SID failed (log: $CACHE/apt.log)"; }
        else
            local m
            m=$(mirror)
            say "first run: debootstrap Debian sid with $SID_PKGS from $m"
            say "  into $SID (~200 MB download, a few minutes; reused later, log: $CACHE/debootstrap.log) ..."
            rm -rf "$SID.tmp"
            debootstrap --variant=minbase --include="$SID_PKGS" sid "$SID.tmp" "$m" \
                >"$CACHE/debootstrap.log" 2>&1 ||
                { tail -n 20 "$CACHE/debootstrap.log"; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
            rm -rf "$SID" && mv "$SID.tmp" "$SID"
            rm -rf "$SID"/var/cache/apt/archives/*.deb
        fi
        mkdir -p "$SID$IN_CHROOT"
        echo "$SID_PKGS" >"$SID/.udrive-vm-ready"
    fi
    flock -u 9
    QEMU_BIN=/usr/bin/qemu-system-x86_64
    [ -x "$SID$QEMU_BIN" ] || die "no $QEMU_BIN in $SID; remove $SID and retry"
    [ -f "$SID/usr/share/qemu/qboot.rom" ] || die "no qboot.rom in $SID/usr/share/qemu"
    chroot "$SID" $QEMU_BIN -device help 2>/dev/null | grep -q '"vfio-user-pci"' ||
        die "$(chroot "$SID" $QEMU_BIN --version | head -n1) in $SID has no vfio-user-pci device"
    say "$(chroot "$SID" $QEMU_BIN --version | head -n1) (chroot $SID)"
}

# ------------------------------------------------------------ guest kernel
ensure_kernel() {
    local dir=$CACHE/kernel pkg deb
    mkdir -p "$dir"
    if [ ! -f "$dir/vmlinuz" ]; then
        pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/ { print $2; exit }')
        if [ -z "$pkg" ]; then
            apt-get update -qq || true
            pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/ { print $2; exit }')
        fi
        [ -n "$pkg" ] || die "apt knows no linux-image-cloud-amd64 (is this Debian 12?)"
        say "downloading $pkg (apt-get download, ~27 MB) ..."
        (cd "$dir" && rm -rf x ./*.deb && apt-get download -q "$pkg" >"$dir/download.log" 2>&1) ||
            die "apt-get download $pkg failed (log: $dir/download.log)"
        deb=$(ls "$dir"/*.deb)
        dpkg-deb -x "$deb" "$dir/x"
        grep -q '^CONFIG_BLK_DEV_NVME=y' "$dir"/x/boot/config-* || die "$pkg does not build in the NVMe driver"
        cp "$dir"/x/boot/vmlinuz-* "$dir/vmlinuz.tmp" && mv "$dir/vmlinuz.tmp" "$dir/vmlinuz"
        basename "$deb" >"$dir/version"
        rm -rf "$dir/x" "$deb"
    fi
    say "kernel: $(cat "$dir/version")"
    cp "$dir/vmlinuz" "$TMP/vmlinuz"
}

# ------------------------------------------------------------ initramfs
# busybox, nvme-cli and fio from the sid chroot, with the libraries ldd lists.
build_initramfs() {
    local r=$TMP/initramfs bin lib
    rm -rf "$r" && mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,etc,lib64}
    cp "$SID/usr/bin/busybox" "$r/bin/busybox"
    for a in $("$r/bin/busybox" --list); do
        [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"
    done
    for bin in /usr/sbin/nvme /usr/bin/fio; do
        cp "$SID$bin" "$r$bin"
        for lib in $(chroot "$SID" ldd "$bin" | grep -oE '/[^ ]+' | sort -u); do
            mkdir -p "$r$(dirname "$lib")"
            cp -L "$SID$lib" "$r$lib"
        done
    done
    cp "$GUEST_INIT" "$r/init" && chmod 755 "$r/init"
    (cd "$r" && find . | "$r/bin/busybox" cpio -o -H newc 2>/dev/null >"$TMP/initramfs.cpio")
    rm -rf "$r"
    say "initramfs: $(du -m "$TMP/initramfs.cpio" | cut -f1) MiB (busybox, nvme-cli, fio + libraries)"
}

# ------------------------------------------------------------ udrive
build_udrive() {
    if [ -n "${UDRIVE_BIN:-}" ]; then
        UDRIVE=$UDRIVE_BIN
    else
        # shellcheck source=/dev/null
        source "$root/scripts/ensure-deps.sh"
        say "cargo build --release -p udrive ..."
        cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p udrive ||
            die "cannot build udrive"
        UDRIVE=${CARGO_TARGET_DIR:-$root/target}/release/udrive
    fi
    [ -x "$UDRIVE" ] || die "no udrive binary at $UDRIVE"
}

start_udrive() {
    say "$UDRIVE serve --vfio-user $TMP/nvme.sock --ns $NS --cpus $UDRIVE_CPUS"
    NO_COLOR=1 RUST_LOG=${RUST_LOG:-info} setpriv --pdeathsig KILL -- \
        "$UDRIVE" serve --vfio-user "$TMP/nvme.sock" --ns "$NS" --cpus "$UDRIVE_CPUS" \
        >"$TMP/udrive.log" 2>&1 </dev/null &
    UDRIVE_PID=$!
    for _ in $(seq 100); do
        [ -S "$TMP/nvme.sock" ] && return 0
        kill -0 "$UDRIVE_PID" 2>/dev/null || break
        sleep 0.1
    done
    tail -n 20 "$TMP/udrive.log"
    die "udrive serve did not create $TMP/nvme.sock"
}

# ------------------------------------------------------------ QEMU in the chroot
start_qemu() {
    local mem=1G d=$IN_CHROOT
    : >"$TMP/console.log"
    QEMU_ARGS=(
        -accel tcg -smp "$VCPUS" -m $mem
        -object memory-backend-memfd,id=mem,size=$mem,share=on -numa node,memdev=mem
        -bios /usr/share/qemu/qboot.rom -nic none -nographic -monitor none
        -serial "file:$d/console.log"
        -kernel "$d/vmlinuz" -initrd "$d/initramfs.cpio"
        -append "console=ttyS0 quiet edd=off panic=-1 rdinit=/init"
    )
    if [ "$DEVICE" = qemu-nvme ]; then
        truncate -s "${NS#*:}" "$TMP/disk.img"
        QEMU_ARGS+=(-drive "file=$d/disk.img,if=none,id=d0,format=raw,discard=unmap"
            -device nvme,serial=selftest,drive=d0)
    else
        QEMU_ARGS+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"$d/nvme.sock\",\"type\":\"unix\"}}")
    fi
    echo "chroot $SID qemu-system-x86_64 ${QEMU_ARGS[*]}" >"$TMP/qemu.cmd"
    # A private mount namespace holds the chroot's mounts: they disappear with QEMU.
    setpriv --pdeathsig KILL -- unshare --mount --propagation private -- sh -c '
        sid=$1 run=$2 d=$3
        shift 3
        mount --bind "$run" "$sid$d" && mount -t proc proc "$sid/proc" &&
            mount --rbind /dev "$sid/dev" && exec chroot "$sid" "$@"' \
        - "$SID" "$TMP" "$d" $QEMU_BIN "${QEMU_ARGS[@]}" >"$TMP/qemu.log" 2>&1 </dev/null &
    QEMU_PID=$!
}

# Streams the guest's marker lines until QEMU exits (or time runs out).
watch_guest() {
    local seen=0 t start=$EPOCHREALTIME lines n boots
    while :; do
        lines=$(grep -aE '^(UDRIVE-|Kernel panic)' "$TMP/console.log" || true)
        n=$(printf '%s' "$lines" | grep -c '' || true)
        if [ "$n" -gt "$seen" ]; then
            printf '%s\n' "$lines" | tail -n +"$((seen + 1))" | head -n "$((n - seen))" |
                while IFS= read -r l; do printf '  [%6ss] %s\n' "$(elapsed "$start")" "$l"; done
            seen=$n
        fi
        kill -0 "$QEMU_PID" 2>/dev/null || break
        t=$(elapsed "$start")
        if [ "${t%.*}" -ge "$TIMEOUT" ]; then
            say "guest did not finish in $TIMEOUT s; killing QEMU"
            HARNESS_FAIL+=("guest-timeout")
            kill -KILL "$QEMU_PID"
            break
        fi
        boots=$(grep -ac 'Kernel panic' "$TMP/console.log" || true)
        if [ "$boots" -gt 0 ]; then
            sleep 2
            say "guest kernel panicked; killing QEMU"
            HARNESS_FAIL+=("guest-panic")
            kill -KILL "$QEMU_PID"
            break
        fi
        sleep 0.5
    done
    QEMU_RC=0
    wait "$QEMU_PID" || QEMU_RC=$?
    QEMU_PID=
}

stop_udrive() {
    kill -TERM "$UDRIVE_PID" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$UDRIVE_PID" 2>/dev/null || break
        sleep 0.1
    done
    local rc=0 killed=''
    if kill -0 "$UDRIVE_PID" 2>/dev/null; then
        kill -KILL "$UDRIVE_PID"
        killed=1
    fi
    wait "$UDRIVE_PID" 2>/dev/null || rc=$?
    UDRIVE_RC=${killed:+"no exit 10 s after SIGTERM"}
    UDRIVE_RC=${UDRIVE_RC:-$rc}
    UDRIVE_PID=
}

# ------------------------------------------------------------ main
HARNESS_FAIL=()
phase "setup: sid chroot with QEMU"
ensure_chroot
phase "setup: guest kernel"
ensure_kernel
phase "setup: initramfs"
build_initramfs
if [ "$DEVICE" = udrive ]; then
    phase "setup: build udrive"
    build_udrive
fi
phase "guest run (2 boots)"
if [ "$DEVICE" = udrive ]; then start_udrive; else say "self-test: QEMU's emulated NVMe, no udrive"; fi
start_qemu
watch_guest
[ "$DEVICE" = udrive ] && stop_udrive
phase ""

# Results: one line per guest check, plus checks made here on the host side.
mapfile -t RESULTS < <(grep -aE '^UDRIVE-RESULT ' "$TMP/console.log" | tr -d '\r' || true)
host_result() { RESULTS+=("UDRIVE-RESULT name=$1 status=$2 detail=$3"); }
if grep -aq '^UDRIVE-DONE phase=2' "$TMP/console.log" && [ "$QEMU_RC" = 0 ]; then
    host_result guest-completed PASS "both boots finished, QEMU exited 0"
else
    host_result guest-completed FAIL "QEMU exit $QEMU_RC; last marker: $(grep -aE '^UDRIVE-(BOOT|DONE)' "$TMP/console.log" | tail -n1) ${HARNESS_FAIL[*]}"
fi
touch "$TMP/udrive.log"
UDRIVE_RC=${UDRIVE_RC:-not run}
n=$(grep -ci 'doorbell buffer configured' "$TMP/udrive.log" || true)
# Configured is not enough: the exit statistics must show doorbells read from the shadow buffer.
reads=$(sed 's/\x1b\[[0-9;]*m//g' "$TMP/udrive.log" | grep -o 'shadow_doorbell_reads=[0-9]*' | tail -n1 | cut -d= -f2)
if [ "$n" -gt 0 ] && [ "${reads:-0}" -gt 0 ]; then
    host_result shadow-doorbells PASS "configured $n time(s), shadow_doorbell_reads=$reads: $(grep -i 'doorbell' "$TMP/udrive.log" | tail -n 2 | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ' | cut -c1-240)"
else
    host_result shadow-doorbells FAIL "udrive logged 'doorbell buffer configured' $n time(s), shadow_doorbell_reads=${reads:-none}"
fi
errors=$(grep -E 'panicked| ERROR ' "$TMP/udrive.log" | head -n 2 | tr '\n' ' ' | cut -c1-240 || true)
warns=$(grep -c ' WARN ' "$TMP/udrive.log" || true)
if [ "$UDRIVE_RC" = 0 ] && [ -z "$errors" ]; then
    host_result udrive-clean-exit PASS "udrive exited 0 on SIGTERM; no panics or ERROR lines, $warns WARN lines"
else
    host_result udrive-clean-exit FAIL "udrive exit status $UDRIVE_RC; $errors"
fi

echo
say "results"
pass=0 fail=0
for r in "${RESULTS[@]}"; do
    re='^UDRIVE-RESULT name=([^ ]*) status=([A-Z]*) detail=(.*)$'
    if [[ $r =~ $re ]]; then
        name=${BASH_REMATCH[1]} status=${BASH_REMATCH[2]} detail=${BASH_REMATCH[3]}
    else
        name=malformed status=FAIL detail=$r
    fi
    [ "$status" = PASS ] || status=FAIL
    if [ "$status" = PASS ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
    printf '  %-4s %-28s %s\n' "$status" "$name" "$detail"
done
if [ "$fail" -gt 0 ]; then
    echo
    say "guest console (last 80 lines of $TMP/console.log):"
    tail -n 80 "$TMP/console.log" | sed 's/^/  console| /'
    say "udrive log (last 40 lines):"
    tail -n 40 "$TMP/udrive.log" | sed 's/^/  udrive| /'
    [ -s "$TMP/qemu.log" ] && { say "QEMU stderr:"; sed 's/^/  qemu| /' "$TMP/qemu.log"; }
fi
echo
say "times:"
printf '  %s\n' "${TIMES[@]}"
say "total $(elapsed "$T0") s"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ] && [ "$pass" -gt 0 ]
