#!/usr/bin/env bash
# The OpenAI Node client test (ctest: node_openai_client, label node).
# Usage: run.sh KVCODEC_CLI MODEL_DIR
# Installs the pinned client with `npm ci` (needs the npm registry, or an npm
# cache that has it); without node/npm or the registry it skips (exit 77)
# saying why, since a skip must never read as a pass.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cli=$1
model=$2
if [ ! -f "$model/config.json" ]; then echo "SKIP: no model at $model"; exit 77; fi
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "SKIP: node/npm absent (scripts/install_deps.sh installs Debian's nodejs and npm)"; exit 77
fi
# A copy, so parallel builds never share one node_modules.
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-node.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$here"/*.test.mjs "$work/"
if ! (cd "$work" && npm ci --no-audit --no-fund --loglevel=error >"$work/npm.log" 2>&1); then
  echo "SKIP: npm ci could not install the pinned openai client (no registry access?):"
  tail -5 "$work/npm.log"
  exit 77
fi
cd "$work" && KVCODEC_CLI="$cli" KVCODEC_MODEL_DIR="$model" node --test
