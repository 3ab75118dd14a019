"""kvcodec.PrefixCodec: a layer's whole prefix in the calibrated kvtc-gpu/4
format, on the CPU (CI) and, where this libkvcodec has CUDA and torch a GPU
(the GPU machine), on the GPU against the CPU bit for bit."""

import pytest

import kvcodec
from conftest import CUDA_BUILT, ON_GPU, SHIPPED, layer_kv

torch = pytest.importorskip("torch")


def test_cpu_round_trip_keeps_raw_tokens_and_counts_every_byte(dump):
    codec = kvcodec.PrefixCodec(SHIPPED, layer=2, max_tokens=1024, sinks=4, window=32)
    k, v = layer_kv(dump, 2, 700)
    enc = codec.encode(k, v)
    assert enc.payload.dtype == torch.uint8 and enc.offsets.dtype == torch.int64
    # 664 coded tokens: 11 streams per row (10 of 64, one of 24), keys and values.
    assert enc.offsets.numel() == 2 * 11 + 1
    assert enc.nbytes == enc.payload.numel() + 8 * enc.offsets.numel()
    assert enc.fp16_bytes == 2 * 2 * 700 * 64 * 2
    assert enc.compression_ratio > 3.0, enc.compression_ratio
    k2, v2 = codec.decode(enc)
    assert k2.shape == k.shape and k2.dtype == torch.bfloat16
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    for a, b in ((kb, k2), (vb, v2)):
        assert torch.equal(a[:, :, :4], b[:, :, :4]) and torch.equal(a[:, :, -32:], b[:, :, -32:])
        mid_a, mid_b = a[:, :, 4:-32].float(), b[:, :, 4:-32].float()
        rel = ((mid_a - mid_b) ** 2).sum() / (mid_a ** 2).sum()
        assert 0 < rel < 0.05, rel
    # Deterministic: the same input, the same bytes.
    again = codec.encode(k, v)
    assert torch.equal(again.payload, enc.payload) and torch.equal(again.offsets, enc.offsets)
    # The integer reconstruction of the same payload: near the exact one.
    ki, vi = kvcodec.PrefixCodec(SHIPPED, layer=2, max_tokens=1024, sinks=4, window=32,
                                 reconstruction="integer").decode(enc)
    for a, b in ((k2, ki), (v2, vi)):
        assert not torch.equal(a, b)
        assert ((a.float() - b.float()) ** 2).sum() < 1e-5 * (a.float() ** 2).sum()


def test_bad_input_raises_errors_that_name_it(dump):
    codec = kvcodec.PrefixCodec(SHIPPED, layer=0, max_tokens=256)
    k, v = layer_kv(dump, 0, 200)
    with pytest.raises(kvcodec.KVCodecError, match="layer 6"):
        kvcodec.PrefixCodec(SHIPPED, layer=6, max_tokens=256)
    with pytest.raises(kvcodec.KVCodecError, match="is not a torch device"):
        kvcodec.PrefixCodec(SHIPPED, layer=0, max_tokens=256, device="tpu?")
    with pytest.raises(kvcodec.KVCodecError, match="must be a torch tensor"):
        codec.encode(k.numpy(), v)
    with pytest.raises(kvcodec.KVCodecError, match=r"expected \[B=1, H_kv=2, S, D=64\]"):
        codec.encode(k[:, :1], v[:, :1])
    with pytest.raises(kvcodec.KVCodecError, match="differ in shape"):
        codec.encode(k, v[:, :, :100])
    with pytest.raises(kvcodec.KVCodecError, match="outside \\[1, max_tokens = 256\\]"):
        codec.encode(torch.cat([k, k], 2), torch.cat([v, v], 2))
    with pytest.raises(kvcodec.KVCodecError, match="not a floating point"):
        codec.encode(k.to(torch.int32), v.to(torch.int32))
    enc = codec.encode(k, v)
    enc.offsets = enc.offsets[:-1].clone()
    with pytest.raises(kvcodec.KVCodecError, match="entries"):
        codec.decode(enc)
    enc = codec.encode(k, v)
    enc.payload = enc.payload[:-1].clone()
    with pytest.raises(kvcodec.KVCodecError, match="raw tokens need") as e:
        codec.decode(enc)
    assert e.value.status_name == "format error"
    with pytest.raises(kvcodec.KVCodecError, match="EncodedPrefix"):
        codec.decode(b"bytes")
    with pytest.raises(kvcodec.KVCodecError, match="reconstructs exactly"):
        kvcodec.PrefixCodec(SHIPPED, layer=0, max_tokens=256, reconstruction="tf32")
    with pytest.raises(kvcodec.KVCodecError, match="'exact', 'tf32' or 'integer'"):
        kvcodec.PrefixCodec(SHIPPED, layer=0, max_tokens=256, reconstruction="fast")
    if not CUDA_BUILT:
        with pytest.raises(kvcodec.KVCodecError, match="built without CUDA") as e:
            kvcodec.PrefixCodec(SHIPPED, layer=0, max_tokens=256, device="cuda")
        assert e.value.status == 6  # KVCODEC_ERROR_UNSUPPORTED


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
@pytest.mark.parametrize("tokens", [70, 1000, 2048])
def test_gpu_codes_and_decodes_the_cpu_bytes_bit_for_bit(dump, tokens):
    for layer in range(6):
        cpu = kvcodec.PrefixCodec(SHIPPED, layer=layer, max_tokens=2048, window=32)
        gpu = kvcodec.PrefixCodec(SHIPPED, layer=layer, max_tokens=2048, window=32, device="cuda")
        k, v = layer_kv(dump, layer, tokens)
        e_cpu = cpu.encode(k, v)
        e_gpu = gpu.encode(k.cuda(), v.cuda())
        assert e_gpu.payload.is_cuda
        assert torch.equal(e_gpu.payload.cpu(), e_cpu.payload), f"layer {layer}: payload bytes differ"
        assert torch.equal(e_gpu.offsets.cpu(), e_cpu.offsets)
        k_cpu, v_cpu = cpu.decode(e_cpu)
        k_gpu, v_gpu = gpu.decode(e_gpu)
        assert k_gpu.is_cuda
        assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu), f"layer {layer}: decode differs"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
def test_gpu_equals_cpu_on_fresh_inputs(dump):
    """Inputs drawn from KVCODEC_GPU_TEST_SEED (a fixed seed without it):
    a batch of 2 slices of the dump at random layers, offsets, lengths and
    first positions, with noise added (f16 or bf16): the GPU's bytes and
    decode are the CPU's, bit for bit."""
    import os
    seed = int(os.environ.get("KVCODEC_GPU_TEST_SEED", "2024"))
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g).item())
    for trial in range(6):
        layer = draw(0, 6)
        tokens = draw(1, 1500)
        first = draw(0, 4096 - tokens + 1)  # positions within max_tokens
        rows_k, rows_v = [], []
        for _ in range(2):
            start = draw(0, 2048 - tokens + 1)
            k, v = layer_kv(dump, draw(0, 6), start + tokens)
            rows_k.append(k[:, :, start:].float()), rows_v.append(v[:, :, start:].float())
        dtype = torch.float16 if trial % 2 else torch.bfloat16
        scale = 0.1 * torch.rand((), generator=g).item()
        k = (torch.cat(rows_k) + scale * torch.randn(torch.cat(rows_k).shape, generator=g)).to(dtype)
        v = (torch.cat(rows_v) + scale * torch.randn(torch.cat(rows_v).shape, generator=g)).to(dtype)
        what = f"seed {seed} trial {trial}: layer {layer}, {tokens} tokens at {first}, {dtype}"
        cpu = kvcodec.PrefixCodec(SHIPPED, layer=layer, batch=2, max_tokens=4096, window=draw(0, 64))
        gpu = kvcodec.PrefixCodec(SHIPPED, layer=layer, batch=2, max_tokens=4096, window=cpu.window,
                                  sinks=cpu.sinks, device="cuda")
        e_cpu = cpu.encode(k, v, first_position=first)
        e_gpu = gpu.encode(k.cuda(), v.cuda(), first_position=first)
        assert torch.equal(e_gpu.payload.cpu(), e_cpu.payload), what
        assert torch.equal(e_gpu.offsets.cpu(), e_cpu.offsets), what
        k_cpu, v_cpu = cpu.decode(e_cpu)
        k_gpu, v_gpu = gpu.decode(e_gpu)
        assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu), what


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
def test_gpu_reports_damaged_streams_and_wrong_devices(dump):
    gpu = kvcodec.PrefixCodec(SHIPPED, layer=1, max_tokens=512, device="cuda")
    k, v = layer_kv(dump, 1, 512)
    with pytest.raises(kvcodec.KVCodecError, match="are on cpu, the codec on cuda"):
        gpu.encode(k, v)
    enc = gpu.encode(k.cuda(), v.cuda())
    bad = kvcodec.EncodedPrefix(enc.payload.clone(), enc.offsets, enc.tokens, enc.batch, enc.n_kv_heads,
                                enc.head_dim)
    bad.payload[: int(enc.offsets[1].item())] ^= 0x5A  # every byte of stream 0
    with pytest.raises(kvcodec.KVCodecError) as e:
        gpu.decode(bad)
    assert e.value.status_name == "format error"
    k2, v2 = gpu.decode(enc)  # the flags were reported once; a good payload decodes
    assert k2.shape == k.shape
    # TF32 reconstruction: the same payload, outputs near the exact ones.
    tf32 = kvcodec.PrefixCodec(SHIPPED, layer=1, max_tokens=512, device="cuda", reconstruction="tf32")
    e32 = tf32.encode(k.cuda(), v.cuda())
    assert torch.equal(e32.payload, enc.payload)
    k3, v3 = tf32.decode(e32)
    assert (k3.float() - k2.float()).abs().max() <= 0.02 * k2.float().abs().max()
    assert (v3.float() - v2.float()).abs().max() <= 0.02 * v2.float().abs().max()
    # Integer reconstruction: the same payload; GPU == CPU bit for bit, and
    # near the exact outputs.
    gi = kvcodec.PrefixCodec(SHIPPED, layer=1, max_tokens=512, device="cuda", reconstruction="integer")
    ci = kvcodec.PrefixCodec(SHIPPED, layer=1, max_tokens=512, reconstruction="integer")
    ei = gi.encode(k.cuda(), v.cuda())
    assert torch.equal(ei.payload, enc.payload)
    k4, v4 = gi.decode(ei)
    k5, v5 = ci.decode(ci.encode(k, v))
    assert torch.equal(k4.cpu(), k5) and torch.equal(v4.cpu(), v5)
    assert (k4.float() - k2.float()).abs().max() <= 0.02 * k2.float().abs().max()
    assert (v4.float() - v2.float()).abs().max() <= 0.02 * v2.float().abs().max()
