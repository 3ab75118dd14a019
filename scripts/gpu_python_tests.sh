#!/usr/bin/env bash
# scripts/gpu_python_tests.sh: one device run, from the repository root of a
# machine with an NVIDIA GPU,
# CUDA, torch and Python 3 (no Debian packages, no network): the Python
# package's GPU == CPU tests of kvcodec.PaluCodec (tests/python/
# test_palu_codec.py), the GPU palu cache (test_palu_block_cache.py), the
# whole-prefix codec (test_prefix.py) and the GPU block cache
# (test_block_cache.py), against the CUDA libkvcodec.so carried here
# (built at 802053b from a clean worktree as build-capi-cuda is
# configured: Release, -DKVCODEC_CUDA=ON, sm_90, static cudart, no
# -march=native; no C++ change since bears on these tests) with the KV
# dump the tests read. pytest where installed,
# else run_tests.py (a stand-in) if the folder has it. The folder
# (KVCODEC_DEVICE_DIR, default out/palu_dev): lib/ (libkvcodec.so of a
# -DKVCODEC_CUDA=ON build, libgomp.so.1, libxxhash.so.0), fallback/ (this
# machine's libstdc++.so.6 and libgcc_s.so.1), shared/models/tinycode/
# kv_dump.safetensors. Carry it and scripts/ to the device. SEED=N fixes the seed
# of the fresh inputs; ALLOW_NO_GPU=1 runs without a GPU (the GPU tests skip).
set -u
cd "$(dirname "$0")/.."
here=${KVCODEC_DEVICE_DIR:-$PWD/out/palu_dev}
[ -n "${OUT:-}" ] && exec > >(tee "$OUT/palu_dev.log") 2>&1
export LD_LIBRARY_PATH=$here/lib:${LD_LIBRARY_PATH:-}
# Debian 12's libstdc++ / libgcc_s only where the machine's own cannot serve
# the library (torch would otherwise get the older copy too).
if ldd "$here/lib/libkvcodec.so" | grep -q "not found"; then
  echo "using the carried libstdc++ / libgcc_s"
  export LD_LIBRARY_PATH=$here/lib:$here/fallback:${LD_LIBRARY_PATH#$here/lib:}
fi
ldd "$here/lib/libkvcodec.so"
export KVCODEC_LIBRARY=$here/lib/libkvcodec.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export KVCODEC_SHARED_DIR=$here/shared KVCODEC_GPU_TEST_SEED=${SEED:-$RANDOM} PYTHONUNBUFFERED=1
echo "seed $KVCODEC_GPU_TEST_SEED"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The GPU tests skip where the library or torch sees no GPU: fail loudly then.
python3 -c "
import sys, torch, kvcodec
n, built = kvcodec.cuda_device_count()
print('python', sys.version.split()[0], 'torch', torch.__version__, 'kvcodec', kvcodec.version(), kvcodec.library_path)
print('cuda devices', n, 'built with cuda', built, 'torch sees', torch.cuda.is_available())
sys.exit(0 if n > 0 and built and torch.cuda.is_available() else 2)" || [ -n "${ALLOW_NO_GPU:-}" ] ||
  { echo "no usable GPU: the GPU tests would skip (ALLOW_NO_GPU=1 runs them anyway)"; exit 2; }
cd tests/python
tests="test_palu_codec.py test_palu_block_cache.py test_prefix.py test_block_cache.py"
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest -v -rs -p no:cacheprovider $tests
else
  python3 "$here/run_tests.py" $tests
fi
rc=$?
echo "tests rc $rc"
exit $rc
