"""kvcodec.Cache: every method round-trips numpy arrays and torch tensors;
saves are the bytes of `kvcodec compress`; bad input raises KVCodecError
naming the problem."""
import os
import subprocess

import numpy as np
import pytest
import torch

import kvcodec
from conftest import container_sections, read_safetensors

METHODS = [("fp16", ""), ("int8", ""), ("int4", "group_size=32"), ("kivi2", {"residual": 32}), ("palu", ""),
           ("kvtc", "mode=local;block=64")]


def synthetic(b=1, h=2, s=200, d=64, seed=0):
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((h, 8, d)).astype(np.float32)
    coef = rng.standard_normal((b, h, s, 8)).astype(np.float32) / np.arange(1, 9, dtype=np.float32)
    return (coef @ basis + 0.01 * rng.standard_normal((b, h, s, d))).astype(np.float32)


def make(method, settings, **kw):
    return kvcodec.Cache(method, settings, n_kv_heads=2, head_dim=64, layer=1, n_layers=6, **kw)


def test_version_and_methods():
    assert kvcodec.version() == "0.1.0"
    assert kvcodec.methods() == ["fp16", "int8", "int4", "kivi2", "palu", "kvtc"]
    assert os.path.isfile(kvcodec.library_path)


@pytest.mark.parametrize("method,settings", METHODS)
def test_numpy_round_trip(method, settings):
    k, v = synthetic(seed=1), synthetic(seed=2)
    cache = make(method, settings)
    # Token-major memory: a strided [B, H, S, D] view, passed without a copy.
    k_t = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    rk, rv = cache.update_and_fetch(k_t[:, :, :150], v[:, :, :150])
    assert rk.shape == (1, 2, 150, 64) and rk.dtype == np.float32
    rk, rv = cache.update_and_fetch(k_t[:, :, 150:], v[:, :, 150:])
    assert rk.shape == (1, 2, 200, 64) and cache.offset == 200 and cache.size() == 200
    rel = float(((rk - k) ** 2).sum() / (k ** 2).sum())
    assert rel < 0.25, rel
    assert cache.fp16_key_bytes == 2 * 200 * 64 * 2
    assert 0 < cache.compressed_key_bytes and 0 < cache.compressed_value_bytes
    assert cache.compression_ratio == pytest.approx((cache.fp16_key_bytes + cache.fp16_value_bytes) /
                                                    (cache.compressed_key_bytes + cache.compressed_value_bytes))
    saved = cache.save()
    loaded = kvcodec.Cache.load(saved)
    lk, lv = loaded.fetch("f32")
    assert np.array_equal(lk, rk) and np.array_equal(lv, rv)
    # Counters are restored exactly; memory held is not: a loaded cache holds
    # its vectors at their exact size, without the appends' growth slack.
    held, loaded_held = cache.stats(), loaded.stats()
    assert loaded_held.pop("resident_bytes") <= held.pop("resident_bytes")
    assert loaded.resident_bytes >= loaded.compressed_key_bytes + loaded.compressed_value_bytes
    assert loaded_held == held and loaded.extras == cache.extras and loaded.save() == saved
    assert loaded.method == method
    # state is the compressed state; assigning it restores one.
    other = make(method, settings)
    other.state = cache.state
    assert other.save() == saved
    if loaded.is_trimmable():
        assert loaded.trim(30) == 30 and loaded.offset == 170
        assert loaded.fp16_key_bytes == 2 * 170 * 64 * 2
        assert loaded.trim(1000) == 170 and loaded.offset == 0


@pytest.mark.parametrize("method,settings", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_round_trip_in_the_input_dtype(method, settings, dtype):
    k = torch.from_numpy(synthetic(seed=3)).to(dtype)
    v = torch.from_numpy(synthetic(seed=4)).to(dtype)
    cache = make(method, settings)
    rk, rv = cache.update_and_fetch(k, v)
    assert isinstance(rk, torch.Tensor) and rk.dtype == dtype and tuple(rk.shape) == (1, 2, 200, 64)
    # The same values in another dtype come back as the library's conversion of them.
    fk, _ = cache.fetch("f32", kind="torch")
    assert torch.equal(fk.to(dtype), rk)
    if method == "fp16":
        assert torch.equal(rk, k) if dtype != torch.float32 else torch.equal(rk, k.half().float())


def test_for_each_block_walks_the_history():
    cache = make("int8", "")
    k, v = synthetic(s=600, seed=5), synthetic(s=600, seed=6)
    fk, fv = cache.update_and_fetch(k, v)
    seen = []
    cache.for_each_block(lambda first, bk, bv: seen.append((first, bk.copy(), bv.copy())) and False)
    assert len(seen) > 1 and seen[0][0] == 0
    assert np.array_equal(np.concatenate([b[1] for b in seen], axis=2), fk)
    firsts = []
    cache.for_each_block(lambda first, bk, bv: firsts.append(first) or True)
    assert firsts == [0]


def test_calibrated_kvtc_shares_one_calibration(calibration_file):
    cal = kvcodec.Calibration(calibration_file)
    assert (cal.n_layers, cal.n_kv_heads, cal.head_dim) == (6, 2, 64) and cal.params_bytes > 0
    caches = [kvcodec.Cache("kvtc", "window=16", n_kv_heads=2, head_dim=64, layer=i, n_layers=6, calibration=cal)
              for i in range(6)]
    for i, c in enumerate(caches):
        c.update_and_fetch(synthetic(seed=10 + i), synthetic(seed=20 + i))
        assert c.compression_ratio > 1.0
        again = kvcodec.Cache.load(c.save())
        assert np.array_equal(again.fetch()[0], c.fetch()[0])


@pytest.mark.parametrize("method,c_settings,cli_sets", [
    ("fp16", "", []), ("int8", "", []), ("int4", "group_size=64", ["--set", "int4.group_size=64"]),
    ("kivi2", "", []), ("palu", "rank=16", ["--set", "palu.rank=16"]),
    ("kvtc", "mode=local;block=128", ["--set", "kvtc.mode=local", "--set", "kvtc.block=128"])])
def test_saves_are_the_bytes_of_kvcodec_compress(cli, kv_dump, tmp_path, method, c_settings, cli_sets):
    out = tmp_path / "dump.kvc"
    subprocess.run([cli, "compress", "--kv", kv_dump, "-o", str(out), "--method", method] + cli_sets, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sections = container_sections(out.read_bytes())
    tensors = read_safetensors(kv_dump)
    n_layers = len([n for n in tensors if n.endswith(".key")])
    for i in range(n_layers):
        k, v = tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"]
        cache = kvcodec.Cache(method, c_settings, n_kv_heads=k.shape[1], head_dim=k.shape[3], layer=i,
                              n_layers=n_layers)
        cache.append(k, v)
        assert cache.save() == sections[f"layer.{i}"], f"layer {i}"


def expect_error(fn, status, words):
    with pytest.raises(kvcodec.KVCodecError) as e:
        fn()
    assert e.value.status == status, (e.value.status, str(e.value))
    assert words in str(e.value), str(e.value)


def test_bad_input_raises_naming_the_problem():
    from kvcodec import _lib
    k = synthetic(s=20)
    expect_error(lambda: make("zip", ""), _lib.INVALID_ARGUMENT, "unknown cache method 'zip'")
    expect_error(lambda: make("kvtc", "block=abc"), _lib.CONFIG, "kvtc.block")
    expect_error(lambda: make("int4", {"colour": "blue"}), _lib.CONFIG, "colour")
    expect_error(lambda: make("kvtc", "calibration=/nonexistent.kvcal"), _lib.NOT_FOUND, "/nonexistent.kvcal")
    expect_error(lambda: kvcodec.Calibration("/nonexistent.kvcal"), _lib.NOT_FOUND, "/nonexistent.kvcal")
    c = make("int8", "")
    expect_error(lambda: c.append(k.astype(np.float64), k.astype(np.float64)), _lib.INVALID_ARGUMENT, "float64")
    expect_error(lambda: c.append(k[0], k[0]), _lib.INVALID_ARGUMENT, "expected 4 dims")
    expect_error(lambda: c.append([1, 2], [3]), _lib.INVALID_ARGUMENT, "not list")
    expect_error(lambda: c.append(k, k.astype(np.float16)), _lib.INVALID_ARGUMENT, "values are f16")
    expect_error(lambda: c.append(k[:, :1], k[:, :1]), _lib.SHAPE_MISMATCH, "expected [B in 1..1048576, 2, S, 64]")
    expect_error(lambda: c.append(torch.zeros(1, 2, 3, 64, dtype=torch.int32), torch.zeros(1, 2, 3, 64)),
                 _lib.INVALID_ARGUMENT, "torch.int32")
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        kc = torch.zeros(1, 2, 3, 64, device="cuda")
        expect_error(lambda: c.append(kc, kc), _lib.UNSUPPORTED, "no GPU codec")
    c.append(k, k)
    expect_error(lambda: c.append(np.concatenate([k, k]), np.concatenate([k, k])), _lib.SHAPE_MISMATCH,
                 "appended to a cache holding batch 1")
    expect_error(lambda: c.trim(-1), _lib.INVALID_ARGUMENT, "negative")
    expect_error(lambda: c.trim("3"), _lib.INVALID_ARGUMENT, "takes an int")
    expect_error(lambda: c.fetch("f64"), _lib.INVALID_ARGUMENT, "'f64'")
    expect_error(lambda: kvcodec.Cache.merge([c, c]), _lib.UNSUPPORTED, "do not merge")
    saved = bytearray(c.save())
    expect_error(lambda: kvcodec.Cache.load(bytes(saved[:len(saved) // 2])), _lib.FORMAT, "kvcodec_cache_load")
    saved[-30] ^= 0x5A
    with pytest.raises(kvcodec.KVCodecError) as e:
        kvcodec.Cache.load(bytes(saved))
    assert e.value.status in (_lib.CHECKSUM, _lib.FORMAT) and "kvcodec_cache_load" in str(e.value)
    expect_error(lambda: kvcodec.Cache.load("not bytes"), _lib.INVALID_ARGUMENT, "takes bytes")
    assert c.offset == 20  # failures changed nothing


def test_device_tensors_need_the_counted_host_round_trip():
    from kvcodec import _lib
    # CI has no GPU: a meta tensor stands for one (device type other than cpu).
    meta = torch.zeros(1, 2, 3, 64, device="meta")
    expect_error(lambda: make("int8", "").append(meta, meta), _lib.UNSUPPORTED, "host_round_trip=True")
    c = make("int8", "", host_round_trip=True)
    expect_error(lambda: c.append(meta, torch.zeros(1, 2, 3, 64)), _lib.INVALID_ARGUMENT, "expected one device")
    # Host tensors are never copied, with or without the option.
    k = torch.from_numpy(synthetic(s=5))
    out_k, out_v = c.update_and_fetch(k, k)
    assert c.host_copy_bytes == 0 and out_k.device.type == "cpu" and out_k.shape == k.shape
