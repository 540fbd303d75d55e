#!/usr/bin/env bash
# Installs what fitmoe needs on Debian 12 (all from Debian's own packages).
set -euo pipefail
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
PKGS="build-essential cmake ninja-build clang nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev \
libbenchmark-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev pkg-config"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
