# Helpers for running SPDK's userspace NVMe tools against udrive; sourced by
# scripts/spdk-client. Not run on its own. (`udrive bench spdk` runs SPDK's nvmf_tgt
# and spdk_nvme_perf as benchmark datapaths itself.)
#
# SPDK is not built here: any SPDK v24+ built with `./configure --with-vfio-user` (v26.05
# was used) provides $SPDK_DIR/build/bin/{spdk_nvme_identify,spdk_nvme_perf,nvmf_tgt}.
# CI cannot build it (its sources come from GitHub, CI has only Debian apt, crates.io and
# PyPI), so everything using this file is opt-in.
#
# The caller sets `spdk_dir` (SPDK tree) and `spdk_tmp` (a private scratch directory) and
# calls `spdk_cleanup` from its EXIT trap.
#
# Every SPDK process runs with `-g` (one hugetlbfs file for all segments; udrive refuses a
# DMA map past the end of its file, docs/attach.md). DPDK names its files after the process id
# (`spdk_pid<PID>`): hugetlbfs files in the hugetlbfs mount and a runtime directory in
# /var/run/dpdk. They outlive the process, so each is removed once its process is gone.

spdk_pids=()          # SPDK processes started (their DPDK files are removed at cleanup)
spdk_hp_orig=         # nr_hugepages before we raised it ("" = unchanged)
spdk_hugedir=/dev/hugepages

spdk_check() {
  local b
  for b in spdk_nvme_identify spdk_nvme_perf; do
    [ -x "$spdk_dir/build/bin/$b" ] || {
      echo "no $spdk_dir/build/bin/$b: set SPDK_DIR to an SPDK tree built with" \
        "./configure --with-vfio-user" >&2
      return 1
    }
  done
}

# Hugepages: a hugetlbfs mount and at least SPDK_HUGEPAGES (default 1024) 2 MiB pages.
# What this changes is undone by spdk_cleanup unless SPDK_KEEP_HUGEPAGES=1.
spdk_hugepages_setup() {
  local want=${SPDK_HUGEPAGES:-1024} have
  spdk_hugedir=$(awk '$3 == "hugetlbfs" { print $2; exit }' /proc/mounts)
  if [ -z "$spdk_hugedir" ]; then
    spdk_hugedir=/dev/hugepages
    mkdir -p "$spdk_hugedir"
    mount -t hugetlbfs nodev "$spdk_hugedir" || {
      echo "cannot mount hugetlbfs on $spdk_hugedir (run as root)" >&2
      return 1
    }
  fi
  have=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$have" -lt "$want" ]; then
    echo "$want" >/proc/sys/vm/nr_hugepages || {
      echo "cannot reserve $want hugepages (run as root)" >&2
      return 1
    }
    spdk_hp_orig=$have
  fi
  local free
  free=$(awk '/HugePages_Free/ { print $2 }' /proc/meminfo)
  [ "$free" -ge 512 ] || { echo "only $free free hugepages" >&2; return 1; }
}

# Removes the DPDK files of SPDK process PID (it must have exited).
spdk_forget() {
  rm -f "$spdk_hugedir/spdk_pid$1"map_* 2>/dev/null || true
  rm -rf "/var/run/dpdk/spdk_pid$1" 2>/dev/null || true
}

# spdk_run OUT CMD ARGS...: runs an SPDK tool in the foreground with output in OUT,
# then removes its DPDK files. Returns the tool's status.
spdk_run() {
  local out=$1 pid rc=0
  shift
  "$@" >"$out" 2>&1 &
  pid=$!
  spdk_pids+=("$pid")
  wait "$pid" || rc=$?
  spdk_forget "$pid"
  return $rc
}

# The transport ID of a vfio-user controller whose socket is DIR/cntrl (SPDK's
# initiator connects to `<traddr>/cntrl`; without a subnqn it treats the controller
# as a discovery controller).
spdk_trid() { # DIR [NSID]
  local t="trtype:VFIOUSER traddr:$1 subnqn:nqn.2019-07.io.spdk:cnode1"
  [ -n "${2:-}" ] && t="$t ns:$2"
  echo "$t"
}

# spdk_perf OUT DIR NSID QD SECS CPU [extra perf args]: one spdk_nvme_perf run of 4 KiB
# random reads (1 s warm-up not counted), prints "IOPS MEAN_US" from its Total line.
spdk_perf() {
  local out=$1 dir=$2 nsid=$3 qd=$4 secs=$5 cpu=$6
  shift 6
  spdk_run "$out" "$spdk_dir/build/bin/spdk_nvme_perf" -g -r "$(spdk_trid "$dir" "$nsid")" \
    -q "$qd" -o 4096 -w randread -t "$secs" -a 1 -c "$(printf '0x%x' $((1 << cpu)))" "$@" || {
    cat "$out" >&2
    return 1
  }
  awk '/^Total/ { print $3, $5; found = 1 } END { exit !found }' "$out" || {
    cat "$out" >&2
    return 1
  }
}

spdk_cleanup() {
  local p
  for p in "${spdk_pids[@]}"; do
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
    spdk_forget "$p"
  done
  if [ -n "$spdk_hp_orig" ] && [ "${SPDK_KEEP_HUGEPAGES:-0}" != 1 ]; then
    echo "$spdk_hp_orig" >/proc/sys/vm/nr_hugepages 2>/dev/null || true
  fi
}
