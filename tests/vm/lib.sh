# shellcheck shell=bash
# Shared parts of the VM test harnesses (tests/vm/run.sh: NVMe over vfio-user,
# tests/vm-vhost/run.sh: virtio-blk over vhost-user). Sourced, never run.
#
# The caller sets before sourcing: root (repo root), TAG (log prefix), CACHE (cache
# directory), then calls `vm_begin CHROOT` (creates TMP, the run directory). Everything
# here is a function, except the shared state listed below.
#
# Shared state: PHASE/TIMES (phase timing), RESULTS (UDRIVE-RESULT lines),
# HARNESS_FAIL (reasons the guest run went wrong), QEMU_PID/QEMU_RC, SERVER_PID (the
# device server, udrive or a peer), VM_EXTRA_PIDS (helpers the trap kills),
# VM_UPGRADE_RPC/VM_TAKEOVER_PIDS (udrive processes `udrive upgrade` started), TMP.

IN_CHROOT=/run/udrive-vm # where the run directory appears inside a chroot
# Modules the virtio-blk guest loads, in load order (Debian's cloud kernel builds
# virtio as modules; the NVMe driver is built in).
VIRTIO_MODULES="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk"

T0=$EPOCHREALTIME
say() { printf '%s: %s\n' "$TAG" "$*"; }
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
PHASE='' PHASE_T='' TIMES=() RESULTS=() HARNESS_FAIL=() QEMU_PID='' QEMU_RC='' SERVER_PID='' TMP=''
VM_EXTRA_PIDS=() VM_TAKEOVER_PIDS=() VM_UPGRADE_RPC=''
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

# ------------------------------------------------------------ chroots
# vm_begin CHROOT: honours UDRIVE_VM_TESTS=0, checks for root, creates TMP (on disk,
# not tmpfs: udrive opens backing files there with O_DIRECT) and sets the trap that
# kills QEMU and the server, unmounts CHROOT's view of TMP and removes TMP.
vm_begin() {
    if [ "${UDRIVE_VM_TESTS:-1}" = 0 ]; then
        say "skipped (UDRIVE_VM_TESTS=0)"
        exit 0
    fi
    [ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts); run with sudo, or set UDRIVE_VM_TESTS=0 to skip"
    VM_CHROOT=$1
    TMP=$(mktemp -d "/tmp/udrive-$TAG.XXXXXX")
    trap vm_cleanup EXIT
    trap 'say "interrupted"; exit 130' INT TERM
}
vm_cleanup() {
    set +e
    local p kids=''
    [ -n "$QEMU_PID" ] && kill -KILL "$QEMU_PID" 2>/dev/null && wait "$QEMU_PID" 2>/dev/null
    # A supervisor's (udrive serve --supervise) server process would outlive it:
    # the supervisor goes first (no more restarts), then what it ran.
    [ -n "$SERVER_PID" ] && kids=$(cat "/proc/$SERVER_PID/task/$SERVER_PID/children" 2>/dev/null)
    [ -n "$SERVER_PID" ] && kill -KILL "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
    for p in $kids "${VM_EXTRA_PIDS[@]}"; do
        kill -KILL "$p" 2>/dev/null && wait "$p" 2>/dev/null
    done
    # A server `udrive upgrade` started is no child of ours and outlives us.
    kill_takeovers
    # A Ceph cluster the run started (ceph_start).
    [ -n "${VM_CEPH_DIR:-}" ] && "$root/scripts/ceph-cluster" stop "$VM_CEPH_DIR" --purge >/dev/null 2>&1
    # QEMU's bind mounts live in its own mount namespace and vanish with it;
    # this only catches a namespace-less leftover.
    mountpoint -q "$VM_CHROOT$IN_CHROOT" 2>/dev/null && umount -l "$VM_CHROOT$IN_CHROOT"
    if [ "${UDRIVE_VM_KEEP:-0}" = 1 ]; then say "kept $TMP"; else rm -rf "$TMP"; fi
}

# check_qemu CHROOT DEVICE: the chroot has QEMU and qboot, and QEMU has DEVICE.
check_qemu() {
    local q=/usr/bin/qemu-system-x86_64 v
    [ -x "$1$q" ] || die "no $q in $1; remove $1 and retry"
    [ -f "$1/usr/share/qemu/qboot.rom" ] || die "no qboot.rom in $1/usr/share/qemu"
    v=$(chroot "$1" $q --version | head -n1)
    chroot "$1" $q -device help 2>/dev/null | grep -q "\"$2\"" || die "$v in $1 has no $2 device"
    say "$v (chroot $1)"
}

mirror() { # the Debian mirror this machine's apt uses
    [ -n "${UDRIVE_VM_MIRROR:-}" ] && { echo "$UDRIVE_VM_MIRROR"; return; }
    local m
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v '^\s*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')
    echo "${m:-http://deb.debian.org/debian}"
}

apt_install_host() { # apt_install_host PKG...: installs missing host packages
    say "installing $* (apt-get) ..."
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"; } >"$TMP/apt-host.log" 2>&1 ||
        { tail -n 20 "$TMP/apt-host.log"; die "cannot install $* with apt-get"; }
}

# ensure_chroot DIR SUITE PKGS: a minbase Debian SUITE chroot at DIR with PKGS
# (comma separated), made once with debootstrap and topped up with apt-get when
# PKGS grows. Cached; one setup at a time (flock), parallel runs then share it.
ensure_chroot() {
    local dir=$1 suite=$2 pkgs=$3 m
    command -v debootstrap >/dev/null || apt_install_host debootstrap
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
    if [ "$(cat "$dir/.udrive-vm-ready" 2>/dev/null)" != "$pkgs" ]; then
        if [ -f "$dir/.udrive-vm-ready" ]; then
            say "adding ${pkgs//,/ } to $dir (apt-get in the chroot) ..."
            cp /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
            unshare --mount --propagation private -- sh -c 'mount -t proc proc "$1/proc" &&
                DEBIAN_FRONTEND=noninteractive chroot "$1" sh -c "apt-get -o Acquire::Check-Valid-Until=false update -qq && apt-get install -y -qq --no-install-recommends $2"' \
                - "$dir" "${pkgs//,/ }" >"$CACHE/apt-$suite.log" 2>&1 ||
                { tail -n 20 "$CACHE/apt-$suite.log"; die "apt-get in $dir failed (log: $CACHE/apt-$suite.log)"; }
        else
            m=$(mirror)
            say "first run: debootstrap Debian $suite with $pkgs from $m"
            say "  into $dir (~200 MB download, a few minutes; reused later, log: $CACHE/debootstrap-$suite.log) ..."
            rm -rf "$dir.tmp"
            debootstrap --variant=minbase --include="$pkgs" "$suite" "$dir.tmp" "$m" \
                >"$CACHE/debootstrap-$suite.log" 2>&1 ||
                { tail -n 20 "$CACHE/debootstrap-$suite.log"; die "debootstrap failed (log: $CACHE/debootstrap-$suite.log)"; }
            rm -rf "$dir" && mv "$dir.tmp" "$dir"
            rm -rf "$dir"/var/cache/apt/archives/*.deb
        fi
        mkdir -p "$dir$IN_CHROOT"
        echo "$pkgs" >"$dir/.udrive-vm-ready"
    fi
    flock -u 9
}

# in_chroot DIR CMD...: runs CMD in chroot DIR inside a private mount namespace that
# bind-mounts $TMP at $IN_CHROOT and mounts /proc and /dev; the mounts vanish with
# CMD. Dies with the harness (PDEATHSIG). CHROOT_CPUS=LIST pins CMD (taskset).
# CHROOT_BINDS="PATH=NAME ..." also shows host file PATH (a socket, a disk image
# outside $TMP) as $IN_CHROOT/NAME.
in_chroot() {
    local dir=$1 pin=()
    shift
    [ -z "${CHROOT_CPUS:-}" ] || pin=(taskset -c "$CHROOT_CPUS")
    setpriv --pdeathsig KILL -- "${pin[@]}" unshare --mount --propagation private -- sh -c '
        dir=$1 run=$2 d=$3 binds=$4
        shift 4
        mount --bind "$run" "$dir$d" && mount -t proc proc "$dir/proc" &&
            mount --rbind /dev "$dir/dev" || exit 1
        for b in $binds; do
            : >"$dir$d/${b##*=}" && mount --bind "${b%=*}" "$dir$d/${b##*=}" || exit 1
        done
        exec chroot "$dir" "$@"' \
        - "$dir" "$TMP" "$IN_CHROOT" "${CHROOT_BINDS:-}" "$@"
}

# ------------------------------------------------------------ guest kernel
# The CPU of TCG guests: QEMU's default model plus RDRAND, so that the guest's
# random pool is ready at boot. Without it a 6.1 kernel makes the first readers
# of /dev/urandom gather jitter entropy, and two vCPUs doing that at once under
# TCG were seen to spin (a soft lockup on both) for minutes.
TCG_CPU=qemu64,+rdrand

# Debian 12's cloud kernel: vmlinuz plus the virtio modules, copied into $TMP
# (vmlinuz) and $TMP/modules/*.ko. Cached in $CACHE/kernel.
ensure_kernel() {
    local dir=$CACHE/kernel pkg deb mod kdir
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
    mkdir -p "$dir"
    if [ ! -f "$dir/vmlinuz" ] || [ "$(cat "$dir/modules/.list" 2>/dev/null)" != "$VIRTIO_MODULES" ]; then
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
        rm -rf "$dir/modules.tmp" && mkdir -p "$dir/modules.tmp"
        kdir=$(ls -d "$dir"/x/lib/modules/*/kernel)
        for mod in $VIRTIO_MODULES; do
            find "$kdir" -name "$mod.ko" -exec cp {} "$dir/modules.tmp/" \;
            [ -f "$dir/modules.tmp/$mod.ko" ] || die "$pkg has no $mod.ko (compressed modules?)"
        done
        echo "$VIRTIO_MODULES" >"$dir/modules.tmp/.list"
        rm -rf "$dir/modules" && mv "$dir/modules.tmp" "$dir/modules"
        cp "$dir"/x/boot/vmlinuz-* "$dir/vmlinuz.tmp" && mv "$dir/vmlinuz.tmp" "$dir/vmlinuz"
        basename "$deb" >"$dir/version"
        rm -rf "$dir/x" "$deb"
    fi
    cp "$dir/vmlinuz" "$TMP/vmlinuz"
    rm -rf "$TMP/modules" && cp -r "$dir/modules" "$TMP/modules"
    flock -u 9
    say "kernel: $(cat "$dir/version")"
}

# ------------------------------------------------------------ initramfs
# initramfs_begin DIR BUSYBOX: a tree at DIR with busybox (and its applets).
initramfs_begin() {
    local r=$1 a
    rm -rf "$r" && mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,etc,lib64}
    cp "$2" "$r/bin/busybox"
    for a in $("$r/bin/busybox" --list); do
        [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"
    done
}
# initramfs_add_bin DIR CHROOT BIN...: binaries from CHROOT with the libraries ldd lists.
initramfs_add_bin() {
    local r=$1 c=$2 bin lib
    shift 2
    for bin in "$@"; do
        cp "$c$bin" "$r$bin"
        for lib in $(chroot "$c" ldd "$bin" | grep -oE '/[^ ]+' | sort -u); do
            mkdir -p "$r$(dirname "$lib")"
            cp -L "$c$lib" "$r$lib"
        done
    done
}
# initramfs_pack DIR INIT OUT: INIT as /init, an uncompressed newc cpio at OUT.
initramfs_pack() {
    local r=$1
    cp "$2" "$r/init" && chmod 755 "$r/init"
    cp "$root/tests/vm/guest-lib.sh" "$r/guest-lib.sh"
    (cd "$r" && find . | "$r/bin/busybox" cpio -o -H newc 2>/dev/null >"$3")
    rm -rf "$r"
}

# ------------------------------------------------------------ udrive
# Sets UDRIVE: $UDRIVE_BIN, or a release build (honours CARGO_TARGET_DIR).
build_udrive() {
    if [ -n "${UDRIVE_BIN:-}" ]; then
        UDRIVE=$UDRIVE_BIN
    else
        # shellcheck source=/dev/null disable=SC2154 # root is the caller's
        source "$root/scripts/ensure-deps.sh"
        say "cargo build --release -p udrive ..."
        cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p udrive ||
            die "cannot build udrive"
        UDRIVE=${CARGO_TARGET_DIR:-$root/target}/release/udrive
    fi
    [ -x "$UDRIVE" ] || die "no udrive binary at $UDRIVE"
}

# wait_socket PATH PID LOG WHAT: waits up to 10 s for a listening socket.
wait_socket() {
    for _ in $(seq 100); do
        [ -S "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || break
        sleep 0.1
    done
    tail -n 20 "$3"
    die "$4 did not create $1"
}

# stop_pid PID: SIGTERM, SIGKILL after 10 s. Sets STOP_RC to the exit status, or
# "no exit 10 s after SIGTERM". (Not in $(...): wait only works in the parent.)
stop_pid() {
    local pid=$1
    STOP_RC=0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid"
        wait "$pid" 2>/dev/null || true
        STOP_RC="no exit 10 s after SIGTERM"
        return
    fi
    # shellcheck disable=SC2034 # read by the caller
    wait "$pid" 2>/dev/null || STOP_RC=$?
}

# ------------------------------------------------------------ live handover
# The pid of the udrive answering the control socket RPC (empty if none answers).
udrive_pid_at() {
    { timeout 10 "$UDRIVE" rpc --rpc "$1" get_version 2>/dev/null || true; } | tr -d ' \n' |
        { grep -oE '"pid":[0-9]+' || true; } | cut -d: -f2
}
# udrive_upgrade N RPC LOG: `udrive upgrade --rpc RPC --log LOG` (90 s at most) and
# the host result upgrade-N: old pid -> new pid and the command's time. Sets
# UPG_OK (1 if a new process serves RPC), UPG_T0 (start), UPG_SECS, UPG_OLD,
# UPG_NEW, UPG_WHY (one line: what the command said). The new process is
# recorded for kill_takeovers (VM_UPGRADE_RPC=RPC does the same for whichever
# process serves at the end).
udrive_upgrade() {
    local n=$1 rpc=$2 log=$3 out rc=0 p why
    VM_UPGRADE_RPC=$rpc
    UPG_OK=0 UPG_OLD=$(udrive_pid_at "$rpc")
    echo "---- $(date -u +%FT%T.%6NZ) harness: udrive upgrade $n (pid ${UPG_OLD:-none} serves)" >>"$log"
    UPG_T0=$EPOCHREALTIME
    out=$(NO_COLOR=1 RUST_LOG=${RUST_LOG:-info} timeout 90 "$UDRIVE" upgrade --rpc "$rpc" --log "$log" 2>&1 </dev/null) || rc=$?
    UPG_SECS=$(awk -v a="$UPG_T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }')
    p=$(grep -oE '\(pid [0-9]+\) is taking over' <<<"$out" | grep -oE '[0-9]+' || true)
    [ -z "$p" ] || VM_TAKEOVER_PIDS+=("$p")
    UPG_NEW=$(udrive_pid_at "$rpc")
    UPG_WHY=$(grep -av 'is taking over' <<<"$out" | tr '\n' ' ' | sed 's/  */ /g' | cut -c1-300)
    if [ "$rc" = 0 ] && [ -n "$UPG_NEW" ] && [ "$UPG_NEW" != "$UPG_OLD" ]; then
        # shellcheck disable=SC2034 # read by the caller
        UPG_OK=1
        host_result "upgrade-$n" PASS "pid $UPG_OLD -> pid $UPG_NEW; udrive upgrade returned after $UPG_SECS s: $(grep -a 'serves' <<<"$out" | tail -n1)"
    else
        # The new process's own words (e.g. the old one's refusal) are in LOG.
        why=$(sed -n "/harness: udrive upgrade $n /,\$p" "$log" | sed 's/\x1b\[[0-9;]*m//g' |
            grep -aiE 'refused|error|failed' | head -n 2 | tr '\n' ' ' | cut -c1-300 || true)
        [ -z "$why" ] || UPG_WHY="$why(udrive upgrade: $UPG_WHY)"
        host_result "upgrade-$n" FAIL "udrive upgrade exit $rc after $UPG_SECS s; pid ${UPG_NEW:-none} serves (was ${UPG_OLD:-none}): $UPG_WHY"
    fi
}
# stop_upgraded RPC: SIGTERM to the udrive serving RPC that `udrive upgrade`
# started (not our child: no exit status), SIGKILL after 10 s. Sets STOP_RC to 0
# once it is gone, or "no exit 10 s after SIGTERM", and STOP_PID.
stop_upgraded() {
    STOP_PID=$(udrive_pid_at "$1") STOP_RC=0
    [ -n "$STOP_PID" ] || { STOP_RC="no udrive answers on $1"; return 0; }
    kill -TERM "$STOP_PID" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$STOP_PID" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL "$STOP_PID" 2>/dev/null || true
    # shellcheck disable=SC2034 # read by the caller
    STOP_RC="no exit 10 s after SIGTERM"
}
# Kills what `udrive upgrade` started: the process serving VM_UPGRADE_RPC and each
# one recorded, if it still runs udrive serve --takeover (pids are not reused blindly).
kill_takeovers() {
    local p
    [ -z "$VM_UPGRADE_RPC" ] || [ ! -S "$VM_UPGRADE_RPC" ] || VM_TAKEOVER_PIDS+=("$(udrive_pid_at "$VM_UPGRADE_RPC")")
    for p in "${VM_TAKEOVER_PIDS[@]}"; do
        [ -n "$p" ] && tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -q -- '--takeover' &&
            kill -KILL "$p" 2>/dev/null
    done
    return 0
}
# tell_guest LINE: one line on the guest's ttyS1 (a QEMU pipe chardev at
# $TMP/ctl.in); never blocks the harness for long.
tell_guest() {
    # shellcheck disable=SC2016 # expanded by sh
    timeout 5 sh -c 'printf "%s\n" "$1" >"$2"' - "$1" "$TMP/ctl.in" ||
        say "could not write to the guest's ttyS1"
}

# ------------------------------------------------------------ guest console
# watch_guest CONSOLE TIMEOUT [HOOK [QUIET]]: streams the guest's marker lines until
# QEMU ($QEMU_PID) exits, TIMEOUT seconds pass or the kernel panics. HOOK, if given,
# is called with each new marker line and once per poll with no argument; it may
# kill QEMU or push to HARNESS_FAIL. Lines matching the regex QUIET are not
# printed (still passed to HOOK). Sets QEMU_RC.
watch_guest() {
    local console=$1 timeout=$2 hook=${3:-} quiet=${4:-} seen=0 t start=$EPOCHREALTIME lines n l
    while :; do
        lines=$(grep -aE '^(UDRIVE-|Kernel panic)' "$console" | tr -d '\r' || true)
        n=$(printf '%s' "$lines" | grep -c '' || true)
        if [ "$n" -gt "$seen" ]; then
            while IFS= read -r l; do
                [ -n "$quiet" ] && [[ $l =~ $quiet ]] || printf '  [%6ss] %s\n' "$(elapsed "$start")" "$l"
                [ -z "$hook" ] || "$hook" "$l"
            done < <(printf '%s\n' "$lines" | tail -n +"$((seen + 1))" | head -n "$((n - seen))")
            seen=$n
        fi
        [ -z "$hook" ] || "$hook"
        kill -0 "$QEMU_PID" 2>/dev/null || break
        t=$(elapsed "$start")
        if [ "${t%.*}" -ge "$timeout" ]; then
            say "guest did not finish in $timeout s; killing QEMU"
            HARNESS_FAIL+=("guest-timeout")
            kill -KILL "$QEMU_PID"
            break
        fi
        if grep -aq 'Kernel panic' "$console"; then
            sleep 2
            say "guest kernel panicked; killing QEMU"
            HARNESS_FAIL+=("guest-panic")
            kill -KILL "$QEMU_PID"
            break
        fi
        sleep 0.5
    done
    QEMU_RC=0
    # shellcheck disable=SC2034 # read by the caller
    wait "$QEMU_PID" || QEMU_RC=$?
    QEMU_PID=
}

# ------------------------------------------------------------ results
host_result() { RESULTS+=("UDRIVE-RESULT name=$1 status=$2 detail=$3"); }
# guest_results CONSOLE: adds the guest's UDRIVE-RESULT lines to RESULTS.
guest_results() {
    local l
    while IFS= read -r l; do RESULTS+=("$l"); done < <(grep -aE '^UDRIVE-RESULT ' "$1" | tr -d '\r' || true)
}
# report CONSOLE LOG...: prints RESULTS, on failure the console tail and the logs,
# the phase times and the closing "N passed, M failed" line; returns 1 on failure.
report() {
    local console=$1 pass=0 fail=0 r name status detail f
    shift
    local re='^UDRIVE-RESULT name=([^ ]*) status=([A-Z]*) detail=(.*)$'
    echo
    say "results"
    for r in "${RESULTS[@]}"; do
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
        say "guest console (last 80 lines of $console):"
        tail -n 80 "$console" | sed 's/^/  console| /'
        for f in "$@"; do
            [ -s "$f" ] || continue
            say "$(basename "$f") (last 40 lines):"
            tail -n 40 "$f" | sed "s/^/  $(basename "$f" .log)| /"
        done
    fi
    echo
    say "times:"
    printf '  %s\n' "${TIMES[@]}"
    say "total $(elapsed "$T0") s"
    echo "$pass passed, $fail failed"
    [ "$fail" = 0 ] && [ "$pass" -gt 0 ]
}

# ceph_start: a throwaway Ceph cluster in $TMP/ceph (stopped by vm_cleanup); sets
# CEPH_CONF.
ceph_start() {
    # shellcheck source=scripts/ensure-ceph.sh
    source "$root/scripts/ensure-ceph.sh"
    VM_CEPH_DIR=$TMP/ceph
    "$root/scripts/ceph-cluster" start "$VM_CEPH_DIR" >"$TMP/ceph.log" 2>&1 ||
        { tail -n 20 "$TMP/ceph.log"; die "cannot start a Ceph cluster (log above)"; }
    CEPH_CONF=$VM_CEPH_DIR/ceph.conf
}
