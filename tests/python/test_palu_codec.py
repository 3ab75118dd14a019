"""kvcodec.PaluCodec: a palu cache's head group coded outside the cache, on
the CPU (CI: the cache's own token-group bytes and reconstruction) and,
where this libkvcodec has CUDA and torch a GPU (the GPU machine), on the GPU
against the CPU bit for bit."""
import os

import pytest

import kvcodec
from conftest import CUDA_BUILT, ON_GPU, container_sections, layer_kv

torch = pytest.importorskip("torch")

B, H, D = 2, 4, 64
SETTINGS = {
    "shared": {"n_head_groups": 2, "min_fit_tokens": 64},
    "joint": {"group_mode": "joint", "n_head_groups": 2, "min_fit_tokens": 64, "group_size": 64},
    "odd widths": {"n_head_groups": 2, "min_fit_tokens": 64, "hi_bit": 5, "lo_bit": 3},  # codes straddle words
}


def synthetic(tokens, seed, heads=H):
    """[B, heads, tokens, D] bfloat16 of rank-8 structure plus noise and an offset."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn((B, heads, 8, D), generator=g)
    coef = torch.randn((B, heads, tokens, 8), generator=g) / torch.arange(1, 9)
    x = coef @ basis + 0.3 * torch.sin(torch.arange(D, dtype=torch.float32)) + 0.01 * torch.randn(
        (B, heads, tokens, D), generator=g)
    return x.to(torch.bfloat16)


def fitted_cache(settings, k, v):
    cache = kvcodec.Cache("palu", settings, n_kv_heads=H, head_dim=D)
    cache.append(k, v)
    return cache


def stored_token_groups(cache, part, group):
    """Group `group`'s token groups in the cache's saved section: u8 mode 1
    (fitted per sequence), then per head group its projection (4 + rank + 2 *
    dim * rank bytes), token groups and f16 tail (src/cache/palu_stream.cpp)."""
    section = container_sections(cache.save())["key" if part == "keys" else "value"]
    assert section[0] == 1
    at, tokens = 1, cache.offset
    for g in range(kvcodec.PaluCodec.head_groups(cache)):
        c = kvcodec.PaluCodec(cache, part, g, max_tokens=1024)
        at += 4 + c.rank + 2 * c.dim * c.rank
        n = tokens // c.group_size * c.group_bytes
        if g == group:
            return section[at:at + n]
        at += n + 2 * (tokens % c.group_size) * c.rows * c.rank


@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_cpu_bytes_are_the_caches_token_groups_and_decode_its_reconstruction(mode):
    k, v = synthetic(200, 1), synthetic(200, 2)
    cache = fitted_cache(SETTINGS[mode], k, v)
    fk, fv = cache.fetch("bf16", kind="torch")
    assert kvcodec.PaluCodec.head_groups(cache) == 2
    for part, x, fetched in (("keys", k, fk), ("values", v, fv)):
        for g in range(2):
            codec = kvcodec.PaluCodec(cache, part, g, max_tokens=256)
            assert (codec.first_head, codec.n_heads, codec.batch) == (2 * g, 2, B)
            assert codec.joint == (mode == "joint") and codec.rows == (B if codec.joint else 2 * B)
            assert codec.first_token == 0 and not codec.keys_without_rope
            S = 192  # whole token groups; the cache keeps the last 8 tokens in its f16 tail
            packed = codec.encode(x[:, :, :S])
            assert packed.dtype == torch.uint8 and packed.shape == (S // codec.group_size, codec.group_bytes)
            assert bytes(packed.numpy()) == stored_token_groups(cache, part, g), f"{part} group {g}"
            y = codec.decode(packed)
            heads = slice(2 * g, 2 * g + 2)
            assert y.shape == (B, 2, S, D) and y.dtype == torch.bfloat16
            assert torch.equal(y, fetched[:, heads, :S]), f"{part} group {g}: not the cache's reconstruction"
            # The group's heads alone code the same; so does any float dtype.
            assert torch.equal(codec.encode(x[:, heads, :S].contiguous()), packed)
            assert torch.equal(codec.encode(x[:, :, :S].float()), packed)


def test_bad_input_raises_errors_that_name_it():
    k, v = synthetic(64, 3), synthetic(64, 4)
    cache = fitted_cache(SETTINGS["shared"], k, v)
    with pytest.raises(kvcodec.KVCodecError, match="not 'palu'"):
        kvcodec.PaluCodec(kvcodec.Cache("int8", n_kv_heads=H, head_dim=D), "keys", max_tokens=64)
    young = kvcodec.Cache("palu", {"min_fit_tokens": 64}, n_kv_heads=H, head_dim=D)
    young.append(k[:, :, :10], v[:, :, :10])
    with pytest.raises(kvcodec.KVCodecError, match=r"not fitted its projections yet \(10 tokens held"):
        kvcodec.PaluCodec(young, "keys", max_tokens=64)
    with pytest.raises(kvcodec.KVCodecError, match="must be a kvcodec.Cache"):
        kvcodec.PaluCodec("cache", "keys", max_tokens=64)
    with pytest.raises(kvcodec.KVCodecError, match="'keys' or 'values'"):
        kvcodec.PaluCodec(cache, "both", max_tokens=64)
    with pytest.raises(kvcodec.KVCodecError, match=r"head_group 2 outside \[0, 2\)") as e:
        kvcodec.PaluCodec(cache, "keys", 2, max_tokens=64)
    assert e.value.status_name == "invalid argument"
    with pytest.raises(kvcodec.KVCodecError, match="is not a torch device"):
        kvcodec.PaluCodec(cache, "keys", max_tokens=64, device="tpu?")
    with pytest.raises(kvcodec.KVCodecError, match="quantize_values=false") as e:
        kvcodec.PaluCodec(fitted_cache({**SETTINGS["shared"], "quantize_values": False}, k, v), "values",
                          max_tokens=64)
    assert e.value.status == 6  # KVCODEC_ERROR_UNSUPPORTED
    codec = kvcodec.PaluCodec(cache, "values", 1, max_tokens=64)
    with pytest.raises(kvcodec.KVCodecError, match="must be a torch tensor"):
        codec.encode([1, 2])
    with pytest.raises(kvcodec.KVCodecError, match=r"expected \[B=2, H_kv=4 \(or the group's 2\), S, D=64\]"):
        codec.encode(v[:, :3])
    with pytest.raises(kvcodec.KVCodecError, match="not a floating point"):
        codec.encode(v.to(torch.int32))
    with pytest.raises(kvcodec.KVCodecError, match="tokens 40 is not a positive multiple of group_size 32 up to "
                                                   "max_tokens 64"):
        codec.encode(v[:, :, :40])
    with pytest.raises(kvcodec.KVCodecError, match="tokens 96 is not"):
        codec.encode(torch.cat([v, v[:, :, :32]], 2))
    with pytest.raises(kvcodec.KVCodecError, match="tokens 0 is not"):
        codec.encode(v[:, :, :0])
    packed = codec.encode(v)
    with pytest.raises(kvcodec.KVCodecError, match="token groups of") as e:
        codec.decode(packed[:, :-1].contiguous())
    assert e.value.status_name == "format error"
    with pytest.raises(kvcodec.KVCodecError, match="expected contiguous uint8"):
        codec.decode(packed.view(torch.int8))
    if not CUDA_BUILT:
        with pytest.raises(kvcodec.KVCodecError, match="built without CUDA") as e:
            kvcodec.PaluCodec(cache, "keys", max_tokens=64, device="cuda")
        assert e.value.status == 6


def _seed():
    seed = int(os.environ.get("KVCODEC_GPU_TEST_SEED", "77"))
    print(f"seed {seed}")
    return seed


def _gpu_equals_cpu(cache, part, g, x, what, max_tokens):
    cpu = kvcodec.PaluCodec(cache, part, g, max_tokens=max_tokens)
    gpu = kvcodec.PaluCodec(cache, part, g, max_tokens=max_tokens, device="cuda")
    p_cpu = cpu.encode(x)
    p_gpu = gpu.encode(x.cuda())
    assert p_gpu.is_cuda
    assert torch.equal(p_gpu.cpu(), p_cpu), f"{what}: packed bytes differ"
    y_cpu = cpu.decode(p_cpu)
    y_gpu = gpu.decode(p_gpu)
    assert y_gpu.is_cuda
    assert torch.equal(y_gpu.cpu(), y_cpu), f"{what}: decode differs"
    return gpu, p_gpu, y_gpu


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_gpu_codes_and_decodes_the_cpu_bytes_bit_for_bit(mode):
    """Projections fitted on one draw, coded on another (more tokens than the
    fit saw, noise scaled at random), from KVCODEC_GPU_TEST_SEED."""
    seed = _seed()
    cache = fitted_cache(SETTINGS[mode], synthetic(200, seed), synthetic(200, seed + 1))
    g_ = torch.Generator().manual_seed(seed)
    for part in ("keys", "values"):
        for g in range(2):
            tokens = 64 * int(torch.randint(1, 17, (1,), generator=g_).item())
            x = synthetic(tokens, seed + 2 + g) + (0.1 * torch.rand((), generator=g_)).to(torch.bfloat16)
            _gpu_equals_cpu(cache, part, g, x, f"{mode} {part} group {g}, {tokens} tokens, seed {seed}", 1024)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA build of libkvcodec and a GPU")
def test_gpu_on_the_dump_and_on_a_side_stream(dump):
    """The shared dump's real KV (2 heads of 64; default palu settings: a
    head per group), the CPU's bytes decoded on the GPU, and a codec queued
    on a non-default stream."""
    for layer in range(6):
        k, v = layer_kv(dump, layer, 1024)
        cache = kvcodec.Cache("palu", n_kv_heads=2, head_dim=64)
        cache.append(k, v)
        for part, x in (("keys", k), ("values", v)):
            for g in range(kvcodec.PaluCodec.head_groups(cache)):
                gpu, p_gpu, y_gpu = _gpu_equals_cpu(cache, part, g, x, f"layer {layer} {part} group {g}", 1024)
    # The last codec: the CPU's bytes on the GPU, then encode and decode on a side stream.
    p_cpu = kvcodec.PaluCodec(cache, "values", g, max_tokens=1024).encode(v)
    assert torch.equal(gpu.decode(p_cpu.cuda()), y_gpu)
    side = torch.cuda.Stream()
    xg = v.cuda()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p_side = gpu.encode(xg)
        y_side = gpu.decode(p_side)
    side.synchronize()
    assert torch.equal(p_side, p_gpu) and torch.equal(y_side, y_gpu)
    with pytest.raises(kvcodec.KVCodecError, match="is on cpu, the codec on cuda"):
        gpu.encode(v)
