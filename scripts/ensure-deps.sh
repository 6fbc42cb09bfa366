#!/usr/bin/env bash
# Installs what building udrive needs on Debian 12 (idempotent, quiet when done).
set -euo pipefail

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
# The font of `udrive trace --plot` / `perf --plot` charts (and their test).
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_apt+=(fonts-dejavu-core)
# The rbd backend links -lrbd -lrados (Ceph's C API; no pkg-config files).
[ -f /usr/include/rbd/librbd.h ] || need_apt+=(librbd-dev)
[ -f /usr/include/rados/librados.h ] || need_apt+=(librados-dev)
# LUKS volumes (`encrypt=luks`): headers and keyslots through libcryptsetup
# (-lcryptsetup); the tests check against the cryptsetup tool and an AES-XTS that
# is not udrive's (Python's cryptography, over OpenSSL).
[ -f /usr/include/libcryptsetup.h ] || need_apt+=(libcryptsetup-dev)
# Their data path's AES-XTS is OpenSSL's EVP (the `openssl` crate links -lcrypto).
[ -f /usr/include/openssl/evp.h ] || need_apt+=(libssl-dev)
command -v cryptsetup >/dev/null 2>&1 || need_apt+=(cryptsetup-bin)
# qcow2 images: the interop tests make and check images with QEMU's own tools.
command -v qemu-img >/dev/null 2>&1 || need_apt+=(qemu-utils)
python3 -c 'import cryptography' >/dev/null 2>&1 || need_apt+=(python3-cryptography)
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
# Rust itself comes from rustup, not apt: the workspace needs Rust >= 1.87 and
# Debian 12's own rustc is 1.63, so installing Debian's cargo would only fail later.
rustup_hint="install Rust >= 1.87 with rustup: apt-get install -y curl && curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\""
if ! command -v cargo >/dev/null 2>&1; then
  echo "udrive: no cargo on the PATH; $rustup_hint" >&2
  exit 1
fi

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "udrive: missing ${need_apt[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "udrive: installing ${need_apt[*]} with apt-get ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

ver=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n1.87.0\n' "$ver" | sort -V | head -n1)" != "1.87.0" ]; then
  echo "udrive: rustc $ver is too old (Debian 12's is 1.63); $rustup_hint" >&2
  exit 1
fi
