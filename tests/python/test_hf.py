"""kvcodec.hf.KVCodecCache against the calls transformers' generate() makes
on a Cache (transformers is not in Debian: a tiny attention model below
makes them in generate()'s order: get_seq_length, get_mask_sizes, then
update per layer, prefill then one token per step, crop/reset between
runs)."""
import pytest
import torch

import kvcodec
from kvcodec import _lib
from kvcodec.hf import KVCodecCache, KVCodecGpuCache


class ReferenceCache:
    """What DynamicCache does: concatenation along S."""

    def __init__(self):
        self.k, self.v = {}, {}

    def get_seq_length(self, layer_idx=0):
        return self.k[layer_idx].shape[2] if layer_idx in self.k else 0

    def get_mask_sizes(self, cache_position, layer_idx=0):
        return self.get_seq_length(layer_idx) + cache_position.shape[0], 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx in self.k:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], key_states], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], value_states], dim=2)
        else:
            self.k[layer_idx], self.v[layer_idx] = key_states, value_states
        return self.k[layer_idx], self.v[layer_idx]


class TinyModel:
    """Embeddings, L attention layers with GQA (H_q = 2 H_kv), a head; shapes [B, H, S, D]."""

    def __init__(self, vocab=50, layers=3, kv_heads=2, head_dim=64, kv_dtype=torch.float32, seed=0):
        # f32 arithmetic (torch 1.13 has no f16 matmul on the CPU); keys and
        # values reach the cache in kv_dtype, as a half-precision model's do.
        g = torch.Generator().manual_seed(seed)
        hidden = 2 * kv_heads * head_dim
        self.L, self.H, self.D, self.kv_dtype = layers, kv_heads, head_dim, kv_dtype
        r = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5
        self.embed, self.head = r(vocab, hidden), r(hidden, vocab)
        self.w = [(r(hidden, hidden), r(hidden, kv_heads * head_dim), r(hidden, kv_heads * head_dim),
                   r(hidden, hidden)) for _ in range(layers)]

    def forward(self, tokens, cache):
        B, q_len = tokens.shape
        past = cache.get_seq_length(0)
        cache_position = torch.arange(past, past + q_len)
        x = self.embed[tokens]
        for i, (wq, wk, wv, wo) in enumerate(self.w):
            kv_len, kv_offset = cache.get_mask_sizes(cache_position, i)
            q = (x @ wq).view(B, q_len, 2 * self.H, self.D).transpose(1, 2)
            # Strided views [B, H_kv, q_len, D], as HF passes them.
            k = (x @ wk).to(self.kv_dtype).view(B, q_len, self.H, self.D).transpose(1, 2)
            v = (x @ wv).to(self.kv_dtype).view(B, q_len, self.H, self.D).transpose(1, 2)
            k, v = cache.update(k, v, i, {"cache_position": cache_position})
            assert k.shape[2] == kv_len and kv_offset == 0
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            scores = (q.float() @ k.float().transpose(2, 3)) / self.D ** 0.5
            mask = torch.arange(kv_len)[None, :] > (cache_position[:, None])
            scores = scores.masked_fill(mask, float("-inf"))
            att = scores.softmax(-1) @ v.float()
            x = x + att.transpose(1, 2).reshape(B, q_len, -1) @ wo
        return x @ self.head

    def generate(self, prompt, cache, steps):
        out, tokens = [], prompt
        for _ in range(steps):
            nxt = self.forward(tokens, cache)[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            tokens = nxt
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_cache_generates_what_the_reference_cache_does(dtype):
    model = TinyModel(kv_dtype=dtype)
    prompt = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, ReferenceCache(), 24)
    cache = KVCodecCache("fp16")
    assert model.generate(prompt, cache, 24) == ref
    assert len(cache) == 3 and cache.get_seq_length() == 40 + 23
    assert cache.fp16_key_bytes == 3 * 2 * 63 * 64 * 2
    assert cache.compression_ratio == pytest.approx(1.0, abs=0.05)


# Bounds on the logits' relative error against the uncompressed forward:
# about twice what each method gives on this random-weight model
# (int8 0.0035, int4 0.059, kivi2 0.30, palu 0.24, kvtc 0.036).
@pytest.mark.parametrize("method,settings,max_rel", [("int8", None, 0.01), ("int4", None, 0.12),
                                                     ("kivi2", "residual=16", 0.6), ("palu", None, 0.5),
                                                     ("kvtc", "mode=local;block=32", 0.08)])
def test_every_method_runs_a_generation(method, settings, max_rel):
    model = TinyModel()
    prompt = torch.randint(0, 50, (1, 160), generator=torch.Generator().manual_seed(2))
    ref_logits = model.forward(prompt, ReferenceCache())
    cache = KVCodecCache(method, settings)
    logits = model.forward(prompt, cache)
    # Compressed keys and values: near the uncompressed forward, not equal to it.
    rel = float((logits - ref_logits).norm() / ref_logits.norm())
    assert 0 < rel < max_rel
    model.generate(prompt[:, -1:], cache, 8)
    assert cache.get_seq_length(2) == 160 + 1 + 7
    assert cache.compression_ratio > 1.5, cache.compression_ratio
    assert cache.compressed_key_bytes > 0 and cache.fp16_value_bytes > cache.compressed_value_bytes


def test_gpu_cache_with_palu_runs_a_generation_with_the_host_caches_fit():
    """KVCodecGpuCache(method="palu") on the CPU (CI; the GPU is
    test_palu_block_cache.py's): its layers are PaluBlockCaches whose
    prefill is their one host copy, and whose coded tokens are the host
    palu cache's bit for bit (bf16 keys, as a bf16 model's)."""
    model = TinyModel(kv_dtype=torch.bfloat16)
    prompt = torch.randint(0, 50, (1, 160), generator=torch.Generator().manual_seed(2))
    ref_logits = model.forward(prompt, ReferenceCache())
    cache = KVCodecGpuCache(max_tokens=256, method="palu", settings="n_head_groups=2")
    host = KVCodecCache("palu", "n_head_groups=2")
    logits = model.forward(prompt, cache)
    model.forward(prompt, host)
    assert 0 < float((logits - ref_logits).norm() / ref_logits.norm()) < 0.5  # palu's bound above
    for ours, theirs in zip(cache.caches, host.caches):
        assert isinstance(ours, kvcodec.PaluBlockCache) and ours.coded_tokens == 160 and ours.host is None
        k, _ = ours.fetch()
        assert torch.equal(k, theirs.fetch("bf16", kind="torch")[0])
    prefill = 3 * 2 * 160 * 2 * 64 * 2  # layers x (keys, values) x tokens x heads x dim x 2 bytes
    model.generate(prompt[:, -1:], cache, 8)
    assert cache.get_seq_length(2) == 160 + 1 + 7 and cache.host_copy_bytes == prefill
    assert cache.compression_ratio > 1.5 and cache.fp16_value_bytes > cache.compressed_value_bytes
    cache.crop(150)
    assert [c.offset for c in cache.caches] == [150] * 3
    for bad, words in [(dict(max_tokens=16, method="int8"), "not 'kvtc' or 'palu'"),
                       (dict(method="palu"), "needs max_tokens"),
                       (dict(calibration="x.kvcal", max_tokens=16, method="palu"), "no kvtc calibration")]:
        with pytest.raises(kvcodec.KVCodecError, match=words):
            KVCodecGpuCache(**bad)


def test_crop_reset_and_refused_batch_operations():
    model = TinyModel()
    cache = KVCodecCache("int8", config=type("Cfg", (), {"num_hidden_layers": 3, "rope_theta": 10000.0})())
    model.forward(torch.randint(0, 50, (1, 30)), cache)
    assert cache.get_seq_length() == 30 and cache.is_sliding == [False] * 3
    assert cache.caches[0].config["n_layers"] == 3
    cache.crop(20)
    assert [c.offset for c in cache.caches] == [20] * 3
    cache.crop(-5)
    assert cache.get_seq_length(1) == 15
    assert cache.get_max_cache_shape() == -1 and cache.get_max_length() is None and not cache.is_compileable
    cache.batch_repeat_interleave(1)
    for call, words in [(lambda: cache.reorder_cache(torch.tensor([0])), "beam search"),
                        (lambda: cache.batch_repeat_interleave(2), "x2"),
                        (lambda: cache.batch_select_indices(torch.tensor([0])), "select batch rows")]:
        with pytest.raises(kvcodec.KVCodecError) as e:
            call()
        assert e.value.status == _lib.UNSUPPORTED and words in str(e.value)
    cache.reset()
    assert cache.get_seq_length() == 0 and len(cache) == 0
    with pytest.raises(kvcodec.KVCodecError) as e:
        cache.update(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), 0)
    assert "expected [B, H_kv, q_len, D]" in str(e.value)


def test_transformers_5_mask_calls():
    # transformers 5.x asks get_query_offset(layer) and get_mask_sizes(query_length: int, layer).
    cache = KVCodecCache("fp16", "")
    assert cache.get_query_offset(0) == 0 and cache.get_mask_sizes(5, 0) == (5, 0)
    k = torch.randn(1, 2, 5, 64)
    cache.update(k, k, 0)
    assert cache.get_query_offset(0) == 5 and cache.get_mask_sizes(1, 0) == (6, 0)
    assert cache.get_mask_sizes(torch.arange(5, 6), 0) == (6, 0)  # 4.x: the cache_position
