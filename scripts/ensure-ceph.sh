#!/usr/bin/env bash
# Installs what the throwaway Ceph cluster of the rbd tests needs (scripts/ceph-cluster):
# ceph-mon, ceph-osd and ceph-common (ceph, rados, rbd, monmaptool, ceph-authtool) from
# Debian 12 (Ceph 16.2). Sourced by scripts that start a cluster, after ensure-deps.sh;
# idempotent and quiet when done. No daemon starts by itself on install.
set -euo pipefail

need_ceph=()
command -v ceph-mon >/dev/null 2>&1 || need_ceph+=(ceph-mon)
command -v ceph-osd >/dev/null 2>&1 || need_ceph+=(ceph-osd)
{ command -v rbd >/dev/null 2>&1 && command -v ceph-authtool >/dev/null 2>&1; } ||
  need_ceph+=(ceph-common)

if [ ${#need_ceph[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "udrive: missing ${need_ceph[*]} (the rbd tests' Ceph cluster); run as root or install them" >&2
    exit 1
  fi
  echo "udrive: installing ${need_ceph[*]} with apt-get ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_ceph[@]}" >/dev/null
fi
