"""kvcodec.BlockCache (one layer compressed in blocks on the tensors' device)
and kvcodec.hf.KVCodecGpuCache, on the CPU in CI and, where libkvcodec has
CUDA and torch a GPU, on the GPU against the CPU bit for bit."""

import pytest

import kvcodec
from conftest import ON_GPU, SHIPPED, layer_kv

torch = pytest.importorskip("torch")


def feed(cache, k, v, pieces):
    """Appends k, v in pieces of the given sizes; returns the last fetch."""
    t = 0
    out = None
    for n in pieces:
        out = cache.update_and_fetch(k[:, :, t:t + n], v[:, :, t:t + n])
        t += n
    assert t == k.shape[2]
    return out


def test_history_is_the_whole_prefix_decode_and_every_token_is_coded_once(dump):
    S, sinks, window, block = 700, 4, 32, 128
    k, v = layer_kv(dump, 3, S)
    cache = kvcodec.BlockCache(SHIPPED, layer=3, max_tokens=1024, sinks=sinks, window=window, block=block)
    # A prefill of 300 tokens, then one token at a time (a decode loop).
    k2, v2 = feed(cache, k, v, [300] + [1] * (S - 300))
    assert k2.dtype == k.dtype and k2.shape == k.shape and cache.offset == S
    coded = (S - sinks - window) // block * block
    assert cache.coded_tokens == coded == 640
    # Blocks of 128 start at positions 4 + 128 j: the whole-prefix codec's
    # streams of 64 from the same first coded token; its window is the tail.
    whole = kvcodec.PrefixCodec(SHIPPED, layer=3, max_tokens=1024, sinks=sinks, window=S - sinks - coded)
    wk, wv = whole.decode(whole.encode(k, v))
    c = slice(sinks, sinks + coded)
    assert torch.equal(k2[:, :, c], wk[:, :, c].to(k.dtype)) and torch.equal(v2[:, :, c], wv[:, :, c].to(v.dtype))
    # The raw sinks and tail: the f16 input itself.
    for got, want in ((k2, k), (v2, v)):
        assert torch.equal(got[:, :, :sinks], want[:, :, :sinks])
        assert torch.equal(got[:, :, sinks + coded:], want[:, :, sinks + coded:])
    # Appends in other pieces give the same history (a block is coded once, from the input).
    again = kvcodec.BlockCache(SHIPPED, layer=3, max_tokens=1024, sinks=sinks, window=window, block=block)
    k3, v3 = feed(again, k, v, [1, 2, 3, 130, 64, 500])
    assert torch.equal(k3, k2) and torch.equal(v3, v2)
    st = cache.stats()
    raw_tokens = S - coded
    assert st["tokens"] == S and st["fp16_key_bytes"] == S * 2 * 64 * 2
    assert st["compressed_key_bytes"] > raw_tokens * 2 * 64 * 2  # the raw part and the blocks' key streams
    assert st["resident_bytes"] == st["compressed_key_bytes"] + st["compressed_value_bytes"]
    stored = sum(e.nbytes for e in cache.blocks) + 2 * raw_tokens * 2 * 64 * 2
    assert st["compressed_key_bytes"] + st["compressed_value_bytes"] == stored
    assert st["compression_ratio"] > 3.0, st
    # The integer reconstruction: the whole-prefix codec's, block for block.
    ic = kvcodec.BlockCache(SHIPPED, layer=3, max_tokens=1024, sinks=sinks, window=window, block=block,
                            reconstruction="integer")
    k4, v4 = feed(ic, k, v, [300, 400])
    wi = kvcodec.PrefixCodec(SHIPPED, layer=3, max_tokens=1024, sinks=sinks, window=S - sinks - coded,
                             reconstruction="integer")
    ik, iv = wi.decode(wi.encode(k, v))
    assert torch.equal(k4[:, :, c], ik[:, :, c].to(k.dtype)) and torch.equal(v4[:, :, c], iv[:, :, c].to(v.dtype))
    assert not torch.equal(k4, k2)


def test_trim_keeps_what_it_keeps_and_bad_input_is_named(dump):
    k, v = layer_kv(dump, 0, 600)
    cache = kvcodec.BlockCache(SHIPPED, layer=0, max_tokens=1024, block=128)
    full_k, _ = cache.update_and_fetch(k, v)
    for n in (10, 100, 300):  # within the tail, into a block, across blocks
        assert cache.trim(n) == n
        tk, _ = cache.fetch()
        assert torch.equal(tk, full_k[:, :, :cache.offset])
        full_k = tk
    cache.trim(cache.offset - 2)
    assert cache.offset == 2 and torch.equal(cache.fetch()[0], k[:, :, :2])
    with pytest.raises(kvcodec.KVCodecError, match="multiple of 64"):
        kvcodec.BlockCache(SHIPPED, layer=0, max_tokens=64, block=100)
    with pytest.raises(kvcodec.KVCodecError, match="exceed max_tokens = 1024"):
        cache.update_and_fetch(torch.cat([k, k], 2), torch.cat([v, v], 2))
    with pytest.raises(kvcodec.KVCodecError, match="differs from the history"):
        cache.update_and_fetch(k[:, :, :1].float(), v[:, :, :1].float())
    with pytest.raises(kvcodec.KVCodecError, match="one shape"):
        cache.update_and_fetch(k[:, :, :2], v[:, :, :1])
    with pytest.raises(kvcodec.KVCodecError, match="empty"):
        kvcodec.BlockCache(SHIPPED, layer=0, max_tokens=64).fetch()


def test_gpu_cache_adapter_runs_the_calls_of_generate_on_the_cpu(dump):
    from kvcodec.hf import KVCodecGpuCache
    cache = KVCodecGpuCache(SHIPPED, max_tokens=512, block=64, window=16)
    k, v = layer_kv(dump, 0, 300)
    for layer in range(6):
        lk, lv = layer_kv(dump, layer, 300)
        out_k, _ = cache.update(lk, lv, layer)
        assert out_k.shape == lk.shape
    assert cache.get_seq_length() == 300 and len(cache) == 6
    assert cache.get_mask_sizes(torch.arange(1)) == (301, 0)
    assert cache.compression_ratio > 2.0 and cache.host_copy_bytes == 0
    cache.crop(250)
    assert cache.get_seq_length() == 250
    with pytest.raises(kvcodec.KVCodecError, match="needs a calibration"):
        KVCodecGpuCache(None, max_tokens=16)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
def test_gpu_block_cache_equals_the_cpu_one_bit_for_bit(dump):
    S = 1500
    for layer in (0, 5):
        k, v = layer_kv(dump, layer, S)
        cpu = kvcodec.BlockCache(SHIPPED, layer=layer, max_tokens=2048, block=256)
        gpu = kvcodec.BlockCache(SHIPPED, layer=layer, max_tokens=2048, block=256, device="cuda")
        pieces = [1000] + [1] * 500
        ck, cv = feed(cpu, k, v, pieces)
        gk, gv = feed(gpu, k.cuda(), v.cuda(), pieces)
        assert gk.is_cuda and gpu.blocks[0].payload.is_cuda
        assert torch.equal(gk.cpu(), ck) and torch.equal(gv.cpu(), cv)
        assert gpu.stats() == cpu.stats()
