"""kvcodec.PaluBlockCache (one layer of palu, token groups coded by
kvcodec.PaluCodec on the tensors' device) against a host
kvcodec.Cache("palu") fed the same appends, on the CPU in CI and, where
libkvcodec has CUDA and torch a GPU, on the GPU against the CPU bit for
bit."""
import pytest

import kvcodec
from conftest import ON_GPU, layer_kv

torch = pytest.importorskip("torch")

H, D = 2, 64  # the dump's layers: 2 kv heads of 64
SETTINGS = {"default": None, "joint": {"group_mode": "joint", "n_head_groups": 1, "group_size": 64},
            "odd widths": {"hi_bit": 5, "lo_bit": 3, "min_fit_tokens": 100}}


def rel_err(x, ref):
    return float(((x.float() - ref.float()) ** 2).sum() / (ref.float() ** 2).sum())


def tail_latent_bytes(cache, part, tail):
    """What the host cache stores for `tail` latent tokens of a part: f16 latents [tail, rows, rank] per group."""
    return sum(2 * tail * c.rows * c.rank for c in cache.codecs[part])


def feed_both(cache, host, k, v, pieces, check=None):
    """Appends k, v in pieces to both caches; check(cache, host, ours, theirs, t) after each."""
    t = 0
    for n in pieces:
        ours = cache.update_and_fetch(k[:, :, t:t + n], v[:, :, t:t + n])
        theirs = host.update_and_fetch(k[:, :, t:t + n], v[:, :, t:t + n])
        t += n
        if check:
            check(cache, host, ours, theirs, t)
    assert t == k.shape[2]
    return ours, theirs


def same_as_host(k, v):
    """The history and bytes a host palu cache gives, where they are comparable (the module's docstring)."""

    def check(cache, host, ours, theirs, t):
        C = cache.coded_tokens
        assert cache.offset == host.offset == t and ours[0].dtype == k.dtype
        if cache.codecs is None:  # before the fit both hold the tokens raw
            assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
            assert cache.host_copy_bytes == 2 * t * H * D * 2
        for o, th, x in zip(ours, theirs, (k, v)):
            assert torch.equal(o[:, :, :C], th[:, :, :C]), f"{t} tokens: coded tokens differ"
            assert torch.equal(o[:, :, C:], x[:, :, C:t]), f"{t} tokens: the raw tail is not the input"
        st, hs = cache.stats(), host.stats()
        assert st["fp16_key_bytes"] == hs["fp16_key_bytes"] and st["tokens"] == t
        for name, part in (("compressed_key_bytes", "keys"), ("compressed_value_bytes", "values")):
            tail = t - C
            want = hs[name] if cache.codecs is None else \
                hs[name] - tail_latent_bytes(cache, part, tail) + tail * H * D * 2
            assert st[name] == want, f"{t} tokens: {name}"
    return check


@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_history_and_bytes_are_the_host_palu_caches(dump, mode):
    """A prefill short of min_fit_tokens, single tokens through the fit, a
    chunk, single tokens: the coded tokens equal the host cache's bit for
    bit (bf16 input), the tail is the input, every byte counted."""
    S = 520
    for layer in (0, 3):
        k, v = (x.to(torch.bfloat16) for x in layer_kv(dump, layer, S))
        cache = kvcodec.PaluBlockCache(SETTINGS[mode], n_kv_heads=H, head_dim=D, max_tokens=1024)
        host = kvcodec.Cache("palu", SETTINGS[mode], n_kv_heads=H, head_dim=D)
        pieces = [90] + [1] * 130 + [77] + [1] * (S - 297)
        ours, theirs = feed_both(cache, host, k, v, pieces, same_as_host(k, v))
        gs = cache.group_size
        assert cache.coded_tokens == S // gs * gs and cache.raw_kv[0].shape[2] == S % gs
        fit_at = 100 if mode == "odd widths" else 128  # min_fit_tokens (default 2 * head_dim)
        assert cache.host is None and cache.host_copy_bytes == 2 * fit_at * H * D * 2
        assert cache.packed["keys"][0].shape[0] >= cache.groups and cache.packed["keys"][0].dtype == torch.uint8
        # The host cache's tail is its low-rank reconstruction, ours is the
        # input there: they differ by palu's own error on those tokens
        # (relative squared error measured on the 6 layers: keys 0.06-0.32,
        # values 0.006-0.08; on the coded tokens after the fit, keys
        # 0.04-0.20, values 0.008-0.07).
        C = cache.coded_tokens
        for th, x in zip(theirs, (k, v)):
            assert 0 < rel_err(th[:, :, C:], x[:, :, C:]) < 0.4
        st = cache.stats()
        assert st["compression_ratio"] > 1.5 and st["resident_bytes"] >= st["compressed_key_bytes"]


def test_f32_and_f16_input_come_back_in_their_dtype_near_the_host_cache(dump):
    # The codec codes bf16 (the host cache f32): close, not equal.
    k, v = layer_kv(dump, 2, 300)
    for dtype in (torch.float32, torch.float16):
        kx, vx = k.to(dtype), v.to(dtype)
        cache = kvcodec.PaluBlockCache(None, n_kv_heads=H, head_dim=D, max_tokens=512)
        host = kvcodec.Cache("palu", None, n_kv_heads=H, head_dim=D)
        ours, theirs = feed_both(cache, host, kx, vx, [200, 1, 1, 98])
        C = cache.coded_tokens
        assert ours[0].dtype == dtype and cache.raw_dtype == torch.float16 and C == 288
        for o, th in zip(ours, theirs):
            assert rel_err(o[:, :, :C], th[:, :, :C]) < 1e-3
        assert torch.equal(ours[0][:, :, C:], kx[:, :, C:].half().to(dtype))


def test_trim_keeps_what_it_keeps_and_refits_as_the_host_cache(dump):
    k, v = (x.to(torch.bfloat16) for x in layer_kv(dump, 1, 700))
    cache = kvcodec.PaluBlockCache(None, n_kv_heads=H, head_dim=D, max_tokens=1024)
    full_k, full_v = cache.update_and_fetch(k[:, :, :600], v[:, :, :600])
    for n in (10, 40, 100):  # within the tail, into a token group, across groups
        assert cache.trim(n) == n
        tk, tv = cache.fetch()
        assert torch.equal(tk, full_k[:, :, :cache.offset]) and torch.equal(tv, full_v[:, :, :cache.offset])
    assert cache.offset == 450 and cache.coded_tokens == 448
    # The decoded tokens put back raw are coded again as the tail fills.
    tk, _ = cache.update_and_fetch(k[:, :, 450:500], v[:, :, 450:500])
    assert cache.coded_tokens == 480 and torch.equal(tk[:, :, :448], full_k[:, :, :448])
    assert cache.trim(10 ** 6) == 500 and cache.offset == 0
    copied = cache.host_copy_bytes
    assert copied == 2 * 600 * H * D * 2  # the first append fitted: all of it went to the host
    # Before the fit a trim reaches the host cache too: the fit sees what a CPU cache's would.
    cache.reset()
    host = kvcodec.Cache("palu", None, n_kv_heads=H, head_dim=D)
    feed_both(cache, host, k[:, :, :100], v[:, :, :100], [100])
    assert cache.trim(30) == 30 and host.trim(30) == 30 and cache.host.offset == 70
    feed_both(cache, host, k[:, :, 70:400], v[:, :, 70:400], [1] * 100 + [230])
    ours, theirs = cache.fetch(), host.fetch("bf16", kind="torch")
    C = cache.coded_tokens
    assert C == 384 and torch.equal(ours[0][:, :, :C], theirs[0][:, :, :C])
    assert torch.equal(ours[1][:, :, :C], theirs[1][:, :, :C])
    assert cache.host_copy_bytes - copied == 2 * (100 + 58) * H * D * 2  # fitted at 70 + 58 = 128 tokens held


def test_bad_input_raises_errors_that_name_it(dump):
    k, v = (x.to(torch.bfloat16) for x in layer_kv(dump, 0, 200))
    cache = kvcodec.PaluBlockCache(None, n_kv_heads=H, head_dim=D, max_tokens=256)
    with pytest.raises(kvcodec.KVCodecError, match="the cache is empty"):
        cache.fetch()
    with pytest.raises(kvcodec.KVCodecError, match="must be a torch tensor"):
        cache.update_and_fetch([1], v)
    with pytest.raises(kvcodec.KVCodecError, match=r"expected two \[B, H_kv=2, q_len, D=64\]") as e:
        cache.update_and_fetch(k[:, :1], v[:, :1])
    assert e.value.status_name == "shape mismatch"
    with pytest.raises(kvcodec.KVCodecError, match="not torch.float32"):
        cache.update_and_fetch(k.double(), v.double())
    cache.update_and_fetch(k, v)
    with pytest.raises(kvcodec.KVCodecError, match=r"expected two \[B=1,"):
        cache.update_and_fetch(torch.cat([k, k])[:, :, :1], torch.cat([v, v])[:, :, :1])
    with pytest.raises(kvcodec.KVCodecError, match="differs from the history"):
        cache.update_and_fetch(k[:, :, :1].float(), v[:, :, :1].float())
    with pytest.raises(kvcodec.KVCodecError, match="exceed max_tokens = 256"):
        cache.update_and_fetch(k[:, :, :57], v[:, :, :57])
    with pytest.raises(kvcodec.KVCodecError, match="calibration") as e:
        kvcodec.PaluBlockCache("calibration=x.pcal", n_kv_heads=H, head_dim=D, max_tokens=256)
    assert e.value.status_name == "unsupported"
    with pytest.raises(kvcodec.KVCodecError, match="palu.rank"):
        kvcodec.PaluBlockCache({"rank": 0}, n_kv_heads=H, head_dim=D, max_tokens=256)
    with pytest.raises(kvcodec.KVCodecError, match="is not a torch device"):
        kvcodec.PaluBlockCache(None, n_kv_heads=H, head_dim=D, max_tokens=256, device="tpu?")
    # Refused by the codec at the fit, naming why.
    for settings, words in (({"quantize_values": False}, "quantize_values=false"),
                            ({"group_size": 16}, "group_size 16 is not a multiple of 32")):
        c = kvcodec.PaluBlockCache(settings, n_kv_heads=H, head_dim=D, max_tokens=256)
        with pytest.raises(kvcodec.KVCodecError, match=words):
            c.update_and_fetch(k, v)
    if not kvcodec.cuda_device_count()[1]:
        with pytest.raises(kvcodec.KVCodecError, match="built without CUDA"):
            kvcodec.PaluBlockCache(None, n_kv_heads=H, head_dim=D, max_tokens=256, device="cuda")


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_gpu_palu_block_cache_equals_the_cpu_one_bit_for_bit(dump, mode):
    S = 1300
    for layer in (0, 5):
        k, v = (x.to(torch.bfloat16) for x in layer_kv(dump, layer, S))
        cpu = kvcodec.PaluBlockCache(SETTINGS[mode], n_kv_heads=H, head_dim=D, max_tokens=2048)
        gpu = kvcodec.PaluBlockCache(SETTINGS[mode], n_kv_heads=H, head_dim=D, max_tokens=2048, device="cuda")
        t = 0
        for n in [60] + [1] * 100 + [1000] + [1] * (S - 1160):
            ck, cv = cpu.update_and_fetch(k[:, :, t:t + n], v[:, :, t:t + n])
            gk, gv = gpu.update_and_fetch(k[:, :, t:t + n].cuda(), v[:, :, t:t + n].cuda())
            t += n
            if n > 1 or t % 97 == 0 or t == S:
                assert gk.is_cuda and torch.equal(gk.cpu(), ck) and torch.equal(gv.cpu(), cv), f"{t} tokens"
        assert gpu.packed["values"][0].is_cuda and gpu.raw_kv[0].is_cuda
        assert gpu.stats() == cpu.stats() and gpu.host_copy_bytes == cpu.host_copy_bytes
        for n in (7, 100):  # a trim into a group decodes it on the GPU
            assert gpu.trim(n) == cpu.trim(n) == n
            assert torch.equal(gpu.fetch()[0].cpu(), cpu.fetch()[0])
