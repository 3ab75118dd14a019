#!/usr/bin/env bash
# Installs the Debian 12 packages kvcodec needs, only those missing (idempotent).
set -euo pipefail
packages=(
  build-essential cmake pkg-config clang libclang-rt-14-dev libomp-14-dev
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  nlohmann-json3-dev libfmt-dev libxxhash-dev libzstd-dev libcpp-httplib-dev
  gnuplot-nox
  python3  # its python3-minimal installs the default eval corpus (docs/eval.md)
  python3-venv python3-numpy python3-torch python3-pytest  # the Python package and its tests (python/, tests/python)
  rustc  # tests/capi: a Rust program against the installed C API
  redis-server libhiredis-dev  # the Redis prefix store (src/server/redis_*) and its tests
  chromium  # headless render of the server dashboard (tests/server skip without it)
  libpng-dev  # tests/server reads the colours of the dashboard's screenshot
)
# tests/node (the official OpenAI Node client, npm `openai`): Debian's nodejs
# and npm, unless npm is already there (a NodeSource nodejs bundles npm and
# conflicts with Debian's npm package).
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
