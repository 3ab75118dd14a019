"""Fixtures of the Python package tests: the shared model's files, the CLI,
and a calibration made once per session by `kvcodec calibrate`.

KVCODEC_CLI (path of the kvcodec binary) and KVCODEC_SHARED_DIR (the folder
holding models/tinycode) come from scripts/test.sh; tests needing them skip
with a message when they are absent.
"""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.environ.get("KVCODEC_SHARED_DIR", os.path.join(HERE, "..", "..", "..", "shared"))
MODEL = os.path.join(SHARED, "models", "tinycode")
# The shipped calibration (the repository's), the shared KV dump, and whether
# this libkvcodec and torch can run the GPU codec (test_prefix.py, test_block_cache.py).
SHIPPED = os.path.join(HERE, "..", "..", "models", "tinycode", "kvtc.kvcal")
DUMP = os.path.join(MODEL, "kv_dump.safetensors")


def read_safetensors(path):
    """{name: numpy array} of a safetensors file (F32, F16, I64; BF16 widened to f32)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        if info["dtype"] == "BF16":  # numpy has no bfloat16: widen the bits to f32 (exact)
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(info["shape"])
            continue
        dtype = {"F32": np.float32, "F16": np.float16, "I64": np.int64}[info["dtype"]]
        out[name] = np.frombuffer(raw, dtype).reshape(info["shape"])
    return out


def container_sections(data):
    """{name: payload bytes} of a kvcodec container (docs/format.md)."""
    assert data[:8] == b"KVCODEC\0"
    (meta_count,) = struct.unpack_from("<I", data, 16)
    pos = 20
    for _ in range(meta_count):
        (klen,) = struct.unpack_from("<H", data, pos)
        (vlen,) = struct.unpack_from("<I", data, pos + 2 + klen)
        pos += 2 + klen + 4 + vlen
    sections = {}
    while pos < len(data) - 16:
        nlen = data[pos]
        name = data[pos + 1:pos + 1 + nlen].decode()
        (plen,) = struct.unpack_from("<Q", data, pos + 1 + nlen)
        start = pos + 1 + nlen + 16
        sections[name] = data[start:start + plen]
        pos = start + plen
    return sections


@pytest.fixture(scope="session")
def cli():
    path = os.environ.get("KVCODEC_CLI")
    if not path or not os.path.isfile(path):
        pytest.skip("KVCODEC_CLI not set to the kvcodec binary")
    return path


@pytest.fixture(scope="session")
def kv_dump():
    path = os.path.join(MODEL, "kv_dump.safetensors")
    if not os.path.isfile(path):
        pytest.skip(f"no KV dump at {path} (shared folder absent)")
    return path


@pytest.fixture(scope="session")
def calibration_file(cli, tmp_path_factory):
    tokens = os.path.join(MODEL, "eval_tokens.u16")
    if not os.path.isfile(tokens):
        pytest.skip(f"no eval tokens at {tokens} (shared folder absent)")
    out = str(tmp_path_factory.mktemp("cal") / "cal.kvcal")
    subprocess.run([cli, "calibrate", "--tokens", tokens, "--windows", "3-3", "--tokens-per-window", "128",
                    "--threads", "1", "--set", "kvtc.target_ratio=8", "--set", "kvtc.sensitivity=none", "-o", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def _cuda_usable():
    try:
        import torch
        import kvcodec
    except ImportError:
        return False, False
    n, built = kvcodec.cuda_device_count()
    return built, n > 0 and built and torch.cuda.is_available()


CUDA_BUILT, ON_GPU = _cuda_usable()


@pytest.fixture(scope="module")
def dump():
    """{name: numpy array} of the shared KV dump (skips without it)."""
    if not os.path.isfile(DUMP):
        pytest.skip(f"no {DUMP}")
    return read_safetensors(DUMP)


def layer_kv(dump, layer, tokens, device="cpu"):
    """Layer `layer`'s first `tokens` keys and values [1, H, S, D] as f16 torch tensors (copies)."""
    import torch
    k = torch.from_numpy(np.array(dump[f"layers.{layer}.key"][:, :, :tokens]))
    v = torch.from_numpy(np.array(dump[f"layers.{layer}.value"][:, :, :tokens]))
    return k.to(device), v.to(device)
