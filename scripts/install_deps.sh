#!/usr/bin/env bash
# Installs the Debian 12 packages kvcodec needs, only those missing (idempotent).
#   scripts/install_deps.sh           what the main job needs
#   scripts/install_deps.sh --tests   and what the test command needs
set -euo pipefail
# What the main job needs (build the library and CLI, run the shipped model):
packages=(
  build-essential cmake pkg-config
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  nlohmann-json3-dev libfmt-dev libxxhash-dev libzstd-dev libcpp-httplib-dev
  libhiredis-dev  # the Redis prefix store's client (src/server/redis_*)
  libpng-dev  # tests/server reads the colours of the dashboard's screenshot (found at configure time)
  python3  # its python3-minimal installs the default eval corpus (docs/eval.md)
)
# --tests: also what the test command needs (sanitizer and fuzz builds, the
# Python package, the C API's Rust test, Redis, the dashboard render, the
# OpenAI Node client). The largest downloads (torch, chromium, rustc, clang)
# are here, so the main job's install stays small.
if [ "${1:-}" = "--tests" ]; then
  packages+=(
    clang libclang-rt-14-dev libomp-14-dev  # scripts/test.sh: ASan/UBSan, libFuzzer and TSan builds
    gnuplot-nox
    python3-venv python3-numpy python3-torch python3-pytest  # the Python package and its tests (python/, tests/python)
    rustc  # tests/capi: a Rust program against the installed C API
    redis-server  # the Redis prefix store's tests start their own
    chromium  # headless render of the server dashboard (tests/server skip without it)
  )
  # tests/node (the official OpenAI Node client, npm `openai`): Debian's nodejs
  # and npm, unless npm is already there (a NodeSource nodejs bundles npm and
  # conflicts with Debian's npm package).
  command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
elif [ $# -gt 0 ]; then
  echo "install_deps.sh: unknown argument '$1' (usage: install_deps.sh [--tests])" >&2
  exit 2
fi
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
