"""PaluBlockCache: one layer's PALU-coded KV kept where its tensors live (a
CUDA GPU, or the CPU), token groups coded by kvcodec.PaluCodec.

    cache = kvcodec.PaluBlockCache("n_head_groups=2", n_kv_heads=8, head_dim=128, max_tokens=8192, device="cuda")
    k, v = cache.update_and_fetch(keys, values)   # [B, H_kv, q, D] in, whole history out

The fit: until the projections are fitted, each append is also copied to
the host (in the raw dtype below) and appended to a host
kvcodec.Cache("palu", settings), which fits them exactly as a CPU palu
cache does (at the append that brings min_fit_tokens tokens, from every
token held). That is the cache's one host copy (device -> host on a GPU),
counted in host_copy_bytes on every device; nothing comes back from it.
Then a PaluCodec per (keys / values, head group) on the tensors' device
takes its projection and the host cache is dropped.

Layout of the history [0, S): before the fit every token raw; after it,
token groups of group_size tokens, each coded once when complete (the
CPU cache's own bytes for them), then the raw tail (< group_size tokens).
Raw tokens are kept in the input's half dtype (bf16 input as bf16, f16 and
f32 as f16: the CPU cache's storage dtype). A fetch decodes every token
group (one decode per head group and part) into the history it returns,
a transient buffer the caller's attention reads and drops: the cache holds
only the packed groups, the raw tokens and, until the fit, the host cache.

Against a host kvcodec.Cache("palu") fed the same appends (tested): the
same fit and token-group bytes, and for bf16 input the same history bit
for bit on the coded tokens (the codec codes and decodes bf16; other
dtypes are rounded to bf16 first and decoded as bf16, where the host cache
works in f32). The tail differs: the host cache keeps it as f16 latents
(projected, not quantized), here it stays raw, so those tokens come back
exact and their bytes are counted as raw. A trim into a token group puts
the group's kept tokens back in the raw tail as their decoded values
(the host cache puts back their dequantized latents); they are coded again
when the tail fills a group. Not supported (refused, KVCodecError
UNSUPPORTED): palu.calibration (its keys are projected with RoPE removed;
nothing here removes it on the device) and quantize_values=false (f16 value
latents: no token groups).
"""
from . import _lib
from ._lib import KVCodecError
from .cache import Cache, settings_text
from .palu_codec import PaluCodec
from ._device import cuda_device_count, resolve_device
from ._layer_cache import HeldLayerCache, StatsAttributes

try:
    import torch
except ImportError:  # pragma: no cover - CI has torch
    torch = None

_PARTS = ("keys", "values")
_EXTRA_PREFIX = {"keys": "key.", "values": "value."}


def _invalid(message):
    return KVCodecError(_lib.INVALID_ARGUMENT, message)


class PaluBlockCache(HeldLayerCache, StatsAttributes):
    """One layer (see the module's docstring). settings: palu's (a dict or
    "field=value;..." text, as kvcodec.Cache takes); n_kv_heads, head_dim:
    the layer's shape; max_tokens: the longest history (the codecs' largest
    call); device: "cpu" / "cuda" / "cuda:N". Input: torch float32,
    float16 or bfloat16 [B, H_kv, q, D]; the history comes back in it."""

    def __init__(self, settings=None, *, n_kv_heads, head_dim, max_tokens, device="cpu"):
        if torch is None:  # pragma: no cover
            raise KVCodecError(_lib.UNSUPPORTED, "PaluBlockCache needs torch")
        fields = [f.split("=", 1)[0].strip() for f in settings_text(settings).split(";")]
        if any(f in ("calibration", "palu.calibration") for f in fields):
            raise KVCodecError(_lib.UNSUPPORTED, "palu.calibration: a calibrated palu cache projects keys with "
                                                 "RoPE removed, which PaluBlockCache does not do on the device; "
                                                 "use kvcodec.Cache for it")
        self.device = resolve_device(device)
        if self.device.type == "cuda" and not cuda_device_count()[1]:
            raise KVCodecError(_lib.UNSUPPORTED, "device cuda: this libkvcodec was built without CUDA "
                                                 "(configure with -DKVCODEC_CUDA=ON)")
        self.settings, self.n_kv_heads, self.head_dim = settings, int(n_kv_heads), int(head_dim)
        self.max_tokens = int(max_tokens)
        self.host_copy_bytes = 0  # bytes handed to the host cache for the fits, over the cache's life
        self.reset()

    def reset(self):
        """Empties the cache; the next tokens are fitted afresh (a new sequence)."""
        self.offset = 0
        # The fit's host cache (kvcodec.Cache checks the settings and shape here).
        self.host = Cache("palu", self.settings, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)
        self.codecs = None       # {"keys": [PaluCodec per head group], "values": [...]} once fitted
        self.packed = None       # the same keys: uint8 [capacity, group_bytes] per head group
        self.groups = 0          # token groups coded, in every codec
        self.group_size = None
        self.projection_bytes = {"keys": 0, "values": 0}  # as the CPU cache stores them
        self.raw_kv = None       # (keys, values) [B, H, raw tokens, D] in raw_dtype
        self.batch = self.dtype = self.raw_dtype = None

    @property
    def coded_tokens(self):
        return self.groups * self.group_size if self.codecs else 0

    def _check(self, keys, values):
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise _invalid(f"{name} must be a torch tensor, not {type(x).__name__}")
            if x.device != self.device:
                raise _invalid(f"{name} are on {x.device}, the cache on {self.device}")
            if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise _invalid(f"{name} dtype {x.dtype} is not torch.float32, torch.float16 or torch.bfloat16")
        if keys.shape != values.shape or keys.dim() != 4 or keys.shape[1] != self.n_kv_heads \
                or keys.shape[3] != self.head_dim or (self.batch is not None and keys.shape[0] != self.batch):
            raise KVCodecError(_lib.SHAPE_MISMATCH, f"keys {tuple(keys.shape)} and values {tuple(values.shape)}: "
                                                    f"expected two [B{'=' + str(self.batch) if self.batch else ''}"
                                                    f", H_kv={self.n_kv_heads}, q_len, D={self.head_dim}] tensors "
                                                    "of one shape")
        if self.dtype is not None and keys.dtype != self.dtype:
            raise _invalid(f"keys dtype {keys.dtype} differs from the history's {self.dtype}")
        if values.dtype != keys.dtype:
            raise _invalid(f"values dtype {values.dtype} differs from the keys' {keys.dtype}")
        if self.offset + keys.shape[2] > self.max_tokens:
            raise _invalid(f"{self.offset} + {keys.shape[2]} tokens exceed max_tokens = {self.max_tokens}")

    def append(self, keys, values):
        """Appends [B, H_kv, q, D] (positions offset .. offset + q - 1)."""
        self._check(keys, values)
        if keys.shape[2] == 0:
            return
        if self.dtype is None:
            self.dtype, self.batch = keys.dtype, int(keys.shape[0])
            self.raw_dtype = torch.bfloat16 if keys.dtype == torch.bfloat16 else torch.float16
        k, v = keys.to(self.raw_dtype), values.to(self.raw_dtype)
        self.raw_kv = (k.contiguous(), v.contiguous()) if self.raw_kv is None else (
            torch.cat([self.raw_kv[0], k], 2), torch.cat([self.raw_kv[1], v], 2))
        self.offset += int(k.shape[2])
        if self.codecs is None:
            self._feed_host(k, v)
        if self.codecs is not None:
            self._code_whole_groups()

    def _feed_host(self, k, v):
        """Before the fit: the host cache gets the same append (counted)."""
        hk, hv = k.detach().to("cpu"), v.detach().to("cpu")
        self.host_copy_bytes += 2 * hk.numel() * hk.element_size()  # counted on the CPU too: one contract
        self.host.append(hk, hv)
        extras = self.host.extras
        if "key.projection_bytes" not in extras:  # not fitted yet: min_fit_tokens not reached
            return
        n = PaluCodec.head_groups(self.host)
        codecs = {p: [PaluCodec(self.host, p, g, max_tokens=self.max_tokens, device=self.device) for g in range(n)]
                  for p in _PARTS}
        self.projection_bytes = {p: int(extras[_EXTRA_PREFIX[p] + "projection_bytes"]) for p in _PARTS}
        self.group_size = codecs["keys"][0].group_size
        self.packed = {p: [torch.empty((0, c.group_bytes), dtype=torch.uint8, device=self.device) for c in codecs[p]]
                       for p in _PARTS}
        self.codecs, self.host = codecs, None  # the projections are the codecs' now

    def _code_whole_groups(self):
        """Codes the raw tail's whole token groups, once each; keeps the rest raw."""
        n = int(self.raw_kv[0].shape[2]) // self.group_size * self.group_size
        if n == 0:
            return
        for p, x in zip(_PARTS, self.raw_kv):
            for i, codec in enumerate(self.codecs[p]):
                self.packed[p][i] = self._grow(self.packed[p][i], codec.encode(x[:, :, :n]))
        self.groups += n // self.group_size
        self.raw_kv = tuple(x[:, :, n:].contiguous() for x in self.raw_kv)

    def _grow(self, buf, new):
        """buf's first `groups` rows then new's, in a buffer grown by doubling."""
        need = self.groups + int(new.shape[0])
        if need > buf.shape[0]:
            bigger = torch.empty((max(need, 2 * int(buf.shape[0])), buf.shape[1]), dtype=torch.uint8,
                                 device=self.device)
            bigger[:self.groups] = buf[:self.groups]
            buf = bigger
        buf[self.groups:need] = new
        return buf

    def _decode_groups(self, p, first, count, out):
        """Token groups [first, first + count) of part p into out [B, H, count * group_size, D]."""
        for codec, buf in zip(self.codecs[p], self.packed[p]):
            packed = buf[first:first + count]
            if first:  # the codec reads 4-byte aligned buffers; a row of buf may not start at one
                packed = packed.clone()
            out[:, codec.first_head:codec.first_head + codec.n_heads] = codec.decode(packed)

    def fetch(self):
        """The whole history [B, H_kv, offset, D] in the input dtype: every
        token group decoded, then the raw tokens."""
        if self.offset == 0:
            raise _invalid("the cache is empty")
        C = self.coded_tokens
        out = []
        for p, raw in zip(_PARTS, self.raw_kv):
            x = torch.empty((self.batch, self.n_kv_heads, self.offset, self.head_dim), dtype=self.dtype,
                            device=self.device)
            if C:
                self._decode_groups(p, 0, self.groups, x[:, :, :C])
            x[:, :, C:] = raw
            out.append(x)
        return out[0], out[1]

    def trim(self, n):
        """Drops the newest n tokens; returns how many. Before the fit the
        host cache drops them too (so the fit sees what a CPU cache would);
        a token group the cut reaches is dropped and its kept tokens come
        back raw into the tail (decoded)."""
        n = max(0, min(int(n), self.offset))
        if n == 0:
            return 0
        keep, C = self.offset - n, self.coded_tokens
        if self.codecs is None:
            self.host.trim(n)
            self.raw_kv = tuple(x[:, :, :keep].contiguous() for x in self.raw_kv)
        elif keep >= C:
            self.raw_kv = tuple(x[:, :, :keep - C].contiguous() for x in self.raw_kv)
        else:
            g = keep // self.group_size  # token groups kept whole
            tail = []
            for p in _PARTS:
                x = torch.empty((self.batch, self.n_kv_heads, self.group_size, self.head_dim), dtype=self.raw_dtype,
                                device=self.device)
                self._decode_groups(p, g, 1, x)
                tail.append(x[:, :, :keep - g * self.group_size].contiguous())
            self.groups, self.raw_kv = g, tuple(tail)
        self.offset = keep
        return n

    # --- bytes -------------------------------------------------------------------

    def stats(self):
        """Stored bytes, per part as the CPU palu cache counts its stream:
        a mode byte, the projection (once fitted), the token groups and the
        raw tokens (2 bytes a value); f16 bytes of the same tokens;
        resident: the packed buffers as allocated, the raw tokens, the
        projections at their stored size and, before the fit, the host
        cache's resident bytes."""
        if self.dtype is None:
            return {"tokens": 0, "compressed_key_bytes": 0, "compressed_value_bytes": 0, "fp16_key_bytes": 0,
                    "fp16_value_bytes": 0, "resident_bytes": 0, "compression_ratio": 0.0}
        raw = self.raw_kv[0].numel() * 2
        stored, resident = {}, raw * 2
        for p in _PARTS:
            groups = sum(self.groups * c.group_bytes for c in self.codecs[p]) if self.codecs else 0
            stored[p] = 1 + self.projection_bytes[p] + groups + raw
            resident += self.projection_bytes[p] + (sum(b.numel() for b in self.packed[p]) if self.codecs else 0)
        if self.host is not None:
            resident += self.host.resident_bytes
        f16 = self.offset * self.batch * self.n_kv_heads * self.head_dim * 2
        total = stored["keys"] + stored["values"]
        return {"tokens": self.offset, "compressed_key_bytes": stored["keys"],
                "compressed_value_bytes": stored["values"], "fp16_key_bytes": f16, "fp16_value_bytes": f16,
                "resident_bytes": resident, "compression_ratio": 2 * f16 / total if total else 0.0}
