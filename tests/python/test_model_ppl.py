"""A PyTorch forward of the shipped model (weights read from its
safetensors, the Llama arithmetic written here) through kvcodec caches gives
the perplexity `kvcodec eval` gives: within 1e-4 relative through fp16
caches; quantizing methods within their sensitivity to f32 rounding (below).

Protocol of `kvcodec eval` (docs/eval.md): window 0 of eval_tokens.u16,
prefill of `context` tokens, then `score - 1` decode steps fed the true
tokens; NLL of tokens context .. context + score - 1; ppl = exp(mean NLL).
Every layer's keys (post-RoPE) and values [1, H_kv, S, D] go through its
kvcodec cache with update_and_fetch; attention reads the reconstruction."""
import json
import math
import os
import subprocess

import numpy as np
import pytest
import torch

import kvcodec
from conftest import MODEL, read_safetensors

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "..", "..", "models", "tinycode")
CONTEXT, SCORE = 192, 24


class Llama:
    def __init__(self, folder):
        self.cfg = json.load(open(os.path.join(folder, "config.json")))
        w = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                w.update({k: torch.from_numpy(np.array(v, np.float32)) for k, v in
                          read_safetensors(os.path.join(folder, name)).items()})
        self.w = w
        c = self.cfg
        self.L, self.Hq, self.Hkv, self.D = (c["num_hidden_layers"], c["num_attention_heads"],
                                             c["num_key_value_heads"], c["head_dim"])
        self.theta = c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta", 10000.0))
        self.eps = c["rms_norm_eps"]

    def norm(self, x, weight):
        # As the runtime: the mean square in double, its inverse root rounded to f32.
        inv = (1.0 / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + self.eps)).float()
        return x * inv * weight

    def rope(self, x, positions):
        half = self.D // 2
        inv_freq = self.theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.D)
        angles = positions.double()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos().float(), angles.sin().float()
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, tokens, position, caches):
        """Logits [n, vocab] of tokens at positions position ..; appends to caches."""
        w, n = self.w, tokens.shape[0]
        pos = torch.arange(position, position + n)
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(self.L):
            p = f"model.layers.{i}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, self.Hq, self.D).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, self.Hkv, self.D).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, self.Hkv, self.D).transpose(0, 1)
            q, k = self.rope(q, pos), self.rope(k, pos)
            keys, values = caches[i].update_and_fetch(k[None].contiguous(), v[None].contiguous())
            keys = keys[0].repeat_interleave(self.Hq // self.Hkv, dim=0)
            values = values[0].repeat_interleave(self.Hq // self.Hkv, dim=0)
            total = keys.shape[1]
            scores = (q @ keys.transpose(1, 2)) / math.sqrt(self.D)
            causal = torch.arange(total)[None, :] > (total - n + torch.arange(n))[:, None]
            att = scores.masked_fill(causal, float("-inf")).softmax(-1) @ values
            x = x + att.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self.norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ \
                w[p + "mlp.down_proj.weight"].T
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return self.norm(x, w["model.norm.weight"]) @ head.T


def perplexity(model, tokens, method, settings):
    caches = [kvcodec.Cache(method, settings, n_kv_heads=model.Hkv, head_dim=model.D, layer=i, n_layers=model.L,
                            rope_theta=model.theta) for i in range(model.L)]
    nll = []
    logits = model.forward(tokens[:CONTEXT], 0, caches)[-1]
    for j in range(SCORE):
        target = int(tokens[CONTEXT + j])
        nll.append(-float(torch.log_softmax(logits.double(), -1)[target]))
        if j + 1 < SCORE:
            logits = model.forward(tokens[CONTEXT + j:CONTEXT + j + 1], CONTEXT + j, caches)[-1]
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def model_and_tokens():
    tokens_path = os.path.join(MODEL, "eval_tokens.u16")
    if not os.path.isfile(tokens_path) or not os.path.isfile(os.path.join(SHIPPED, "config.json")):
        pytest.skip("no eval tokens or shipped model")
    tokens = torch.from_numpy(np.fromfile(tokens_path, np.uint16)[:2048].astype(np.int64))
    return Llama(SHIPPED), tokens, tokens_path


# (method, settings, relative tolerance). fp16: 1e-4, what the forward must
# reach (measured 4.6e-5). The quantizing methods see this forward's keys,
# which differ from the C++ runtime's in the last f32 bits (summation order),
# and their codes are not continuous in the input: multiplying every weight
# by (1 + 1e-7) moved this forward's own perplexity by 2.0e-4 (int4) and
# 0.67% (kvtc local) on this protocol; against kvcodec eval they measured
# 2.0e-4 and 2.2%. Their tolerances cover that; saves from identical inputs
# are byte-identical (test_cache.py). kvtc runs at bit_budget=256 (dp), the
# local defaults those figures were measured with: the rate allocator of
# today's defaults picks its step by bisection on the measured distortion,
# another discontinuity in the input (3.1% apart here), not a forward error.
METHODS = [("fp16", "", 1e-4), ("int4", "", 1e-3), ("kvtc", "mode=local;block=64;bit_budget=256", 3e-2)]


def test_perplexity_matches_kvcodec_eval(cli, model_and_tokens):
    model, tokens, tokens_path = model_and_tokens
    sets = []
    for method, settings, _ in METHODS:
        sets += [f"--set={method}.{item}" for item in settings.split(";") if item]
    out = subprocess.run([cli, "eval", "--model", SHIPPED, "--tokens", tokens_path, "--windows", "1",
                          "--context", str(CONTEXT), "--score", str(SCORE), "--threads", "1", "--json",
                          "--methods", ",".join(m for m, _, _ in METHODS)] + sets,
                         check=True, capture_output=True, text=True).stdout
    ref = {r["method"]: r["ppl"] for r in json.loads(out)}
    for method, settings, tolerance in METHODS:
        got = perplexity(model, tokens, method, settings)
        assert abs(got - ref[method]) <= tolerance * ref[method], (method, got, ref[method])
