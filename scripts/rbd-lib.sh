# shellcheck shell=bash
# What scripts/bench-rbd and scripts/rbd-threads share: the packages, the udrive
# binary, a throwaway cluster with one written image, and CPU ticks from /proc.
# Source it after defining say() and die(); it sets U (the udrive binary).
#
#   rbd_cluster_start DIR MIB  start scripts/ceph-cluster in DIR/ceph, create rbd/bench
#                              (MIB MiB) and write it through once, so reads hit data;
#                              sets CONF, OSD_PID and MON_PID
#   rbd_cluster_stop DIR       stop and purge that cluster (for the caller's cleanup)
# and scripts/proc-ticks.sh's stat_ticks and reactor_ticks.

rbd_lib_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/ensure-deps.sh
source "$rbd_lib_root/scripts/ensure-deps.sh"
# shellcheck source=scripts/ensure-ceph.sh
source "$rbd_lib_root/scripts/ensure-ceph.sh"
# shellcheck source=scripts/proc-ticks.sh
source "$rbd_lib_root/scripts/proc-ticks.sh"
if [ -n "${UDRIVE_BIN:-}" ]; then
    U=$UDRIVE_BIN
else
    say "cargo build --release -p udrive ..."
    cargo build --release --quiet --manifest-path "$rbd_lib_root/Cargo.toml" -p udrive
    U=${CARGO_TARGET_DIR:-$rbd_lib_root/target}/release/udrive
fi
[ -x "$U" ] || die "UDRIVE_BIN=$U is not an executable"

rbd_cluster_start() {
    local dir=$1 mib=$2
    say "starting a throwaway cluster ..."
    "$rbd_lib_root/scripts/ceph-cluster" start "$dir/ceph" >"$dir/cluster.log" 2>&1 ||
        { cat "$dir/cluster.log" >&2; die "no cluster (log above)"; }
    CONF=$dir/ceph/ceph.conf
    OSD_PID=$(cat "$dir/ceph/run/osd.0.pid")
    MON_PID=$(cat "$dir/ceph/run/mon.a.pid")
    rbd --conf "$CONF" create --size "${mib}M" rbd/bench
    say "writing the $mib MiB image once ..."
    rbd --conf "$CONF" bench --io-type write --io-size 4M --io-threads 4 --io-total "${mib}M" \
        --io-pattern seq rbd/bench >/dev/null
}

rbd_cluster_stop() {
    "$rbd_lib_root/scripts/ceph-cluster" stop "$1/ceph" --purge >/dev/null 2>&1
}
