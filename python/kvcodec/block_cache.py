"""BlockCache: one layer's KV kept compressed where its tensors live (a CUDA
GPU, or the CPU), in blocks coded once by kvcodec.PrefixCodec.

    cache = kvcodec.BlockCache(calibration, layer=3, max_tokens=8192, device="cuda")
    k, v = cache.update_and_fetch(keys, values)   # [B, H_kv, q, D] in, whole history out

Layout of the history [0, S): the first `sinks` tokens raw; then blocks of
`block` tokens (a multiple of 64), each coded once, at its own position,
when `window` newer tokens follow it; then the raw tail (at most window +
block - 1 tokens), kept in the input's half-precision dtype (bf16 input as
bf16, f16 and f32 input as f16: 2 bytes a value). Appending is O(1) per token (a block is coded once, from
the input, never re-coded); a fetch decodes every block (on the GPU: one
decode per block, queued on the current stream) into a transient buffer the
caller's attention reads and drops: the cache itself holds only the raw
sinks and tail (bf16) and the blocks' payloads and offsets, all counted in
resident_bytes. Keys and values never leave their device.
"""
from . import _lib
from ._lib import KVCodecError
from .cache import Calibration
from .prefix import PrefixCodec
from ._layer_cache import HeldLayerCache

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


class BlockCache(HeldLayerCache):
    """One layer (see the module's docstring). calibration: a
    kvcodec.Calibration or a path (per-layer, `kvcodec calibrate`); layer:
    its index; max_tokens: the longest history (the RoPE tables); batch: B;
    device: "cpu" / "cuda" / "cuda:N"; reconstruction: "exact", "tf32"
    (GPU) or "integer" (kvcodec.PrefixCodec's). Input may be any float
    dtype; the history comes back in it."""

    def __init__(self, calibration, layer, *, max_tokens, batch=1, sinks=4, window=32, block=256, device="cpu",
                 reconstruction="exact"):
        if block <= 0 or block % 64:
            raise KVCodecError(_lib.INVALID_ARGUMENT, f"block {block} is not a positive multiple of 64 "
                                                      "(the codec's stream length)")
        if sinks < 0 or window < 0:
            raise KVCodecError(_lib.INVALID_ARGUMENT, f"sinks {sinks} and window {window} must be >= 0")
        if not isinstance(calibration, Calibration):
            calibration = Calibration(calibration)
        self.calibration = calibration
        self.codec = PrefixCodec(calibration, layer, max_tokens=max_tokens, batch=batch, sinks=0, window=0,
                                 device=device, reconstruction=reconstruction)
        self.device = self.codec.device
        self.sinks, self.window, self.block, self.batch = int(sinks), int(window), int(block), int(batch)
        self.max_tokens = int(max_tokens)
        self.reset()

    def reset(self):
        self.offset = 0
        self.blocks = []        # EncodedPrefix per coded block, in order
        self.sink_kv = None     # (keys, values) [B, H, <= sinks, D] in raw_dtype
        self.tail_kv = None     # (keys, values) [B, H, tail, D] in raw_dtype
        self.dtype = None       # the input's (and the fetched history's)
        self.raw_dtype = None   # bf16 for bf16 input, else f16

    @property
    def coded_tokens(self):
        return len(self.blocks) * self.block

    def _check(self, keys, values):
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise KVCodecError(_lib.INVALID_ARGUMENT, f"{name} must be a torch tensor, not {type(x).__name__}")
            if x.device != self.device:
                raise KVCodecError(_lib.INVALID_ARGUMENT, f"{name} are on {x.device}, the cache on {self.device}")
        if keys.shape != values.shape or keys.dim() != 4:
            raise KVCodecError(_lib.SHAPE_MISMATCH, f"keys {tuple(keys.shape)} and values {tuple(values.shape)}: "
                                                    "expected two [B, H_kv, q_len, D] tensors of one shape")
        if self.dtype is not None and keys.dtype != self.dtype:
            raise KVCodecError(_lib.INVALID_ARGUMENT, f"keys dtype {keys.dtype} differs from the history's "
                                                      f"{self.dtype}")
        if self.offset + keys.shape[2] > self.max_tokens:
            raise KVCodecError(_lib.INVALID_ARGUMENT, f"{self.offset} + {keys.shape[2]} tokens exceed "
                                                      f"max_tokens = {self.max_tokens}")

    def append(self, keys, values):
        """Appends [B, H_kv, q, D] (positions offset .. offset + q - 1)."""
        self._check(keys, values)
        self.dtype = keys.dtype
        self.raw_dtype = torch.bfloat16 if keys.dtype == torch.bfloat16 else torch.float16
        k, v = keys.to(self.raw_dtype), values.to(self.raw_dtype)
        if self.offset < self.sinks:
            n = min(self.sinks - self.offset, k.shape[2])
            sk, sv = k[:, :, :n], v[:, :, :n]
            if self.sink_kv is None:
                self.sink_kv = (sk.contiguous(), sv.contiguous())
            else:
                self.sink_kv = (torch.cat([self.sink_kv[0], sk], 2), torch.cat([self.sink_kv[1], sv], 2))
            k, v = k[:, :, n:], v[:, :, n:]
            self.offset += n
        if k.shape[2] == 0:
            return
        self.tail_kv = (k.contiguous(), v.contiguous()) if self.tail_kv is None else (
            torch.cat([self.tail_kv[0], k], 2), torch.cat([self.tail_kv[1], v], 2))
        self.offset += k.shape[2]
        # Code every block that has `window` newer tokens after it: each
        # token is coded once, at its position.
        while self.tail_kv[0].shape[2] - self.window >= self.block:
            tk, tv = self.tail_kv
            first = self.sinks + self.coded_tokens
            self.blocks.append(self.codec.encode(tk[:, :, :self.block], tv[:, :, :self.block], first_position=first))
            self.tail_kv = (tk[:, :, self.block:].contiguous(), tv[:, :, self.block:].contiguous())

    def fetch(self):
        """The whole history [B, H_kv, offset, D] in the input dtype: sinks,
        every block decoded, the tail."""
        if self.offset == 0:
            raise KVCodecError(_lib.INVALID_ARGUMENT, "the cache is empty")
        parts = []
        if self.sink_kv is not None:
            parts.append(self.sink_kv)
        for enc in self.blocks:
            parts.append(self.codec.decode(enc, check=False))
        if self.blocks:
            self.codec.check()
        if self.tail_kv is not None:
            parts.append(self.tail_kv)
        return (torch.cat([p[0].to(self.dtype) for p in parts], 2),
                torch.cat([p[1].to(self.dtype) for p in parts], 2))

    def trim(self, n):
        """Drops the newest n tokens; a coded block they reach is dropped whole
        and its kept tokens come back raw into the tail (decoded). Returns n."""
        n = max(0, min(int(n), self.offset))
        keep = self.offset - n
        if keep < self.sinks + self.coded_tokens and keep > self.sinks:
            b = (keep - self.sinks) // self.block  # blocks kept whole
            k, v = self.fetch()
            k, v = k.to(self.raw_dtype), v.to(self.raw_dtype)
            start = self.sinks + b * self.block
            self.blocks = self.blocks[:b]
            self.tail_kv = (k[:, :, start:keep].contiguous(), v[:, :, start:keep].contiguous())
        elif keep <= self.sinks:
            self.blocks, self.tail_kv = [], None
            if self.sink_kv is not None:
                self.sink_kv = (self.sink_kv[0][:, :, :keep].contiguous(), self.sink_kv[1][:, :, :keep].contiguous())
        else:
            t = keep - self.sinks - self.coded_tokens
            self.tail_kv = (self.tail_kv[0][:, :, :t].contiguous(), self.tail_kv[1][:, :, :t].contiguous())
        self.offset = keep
        return n

    # --- bytes -------------------------------------------------------------------

    host_copy_bytes = 0  # nothing crosses to the host: the codec runs on the tensors' device

    def _raw_bytes(self):
        return sum(t.numel() * 2 for pair in (self.sink_kv, self.tail_kv) if pair is not None for t in pair)

    def stats(self):
        """Stored bytes as held: every block's payload and offsets, the raw
        sinks and tail; f16 bytes of the same tokens; resident = stored (the
        cache holds nothing else: fetched histories are the caller's)."""
        key_bytes = value_bytes = 0
        for enc in self.blocks:
            off = enc.offsets.cpu()
            rows = off.numel() - 1  # streams: keys' rows first, then values'
            key_end = int(off[rows // 2])
            key_bytes += key_end + 8 * (rows // 2)
            value_bytes += enc.payload.numel() - key_end + 8 * (rows - rows // 2 + 1)
        raw = self._raw_bytes() // 2
        cal = self.calibration
        f16 = self.offset * self.batch * cal.n_kv_heads * cal.head_dim * 2
        key_bytes, value_bytes = key_bytes + raw, value_bytes + raw
        return {"tokens": self.offset, "compressed_key_bytes": key_bytes, "compressed_value_bytes": value_bytes,
                "fp16_key_bytes": f16, "fp16_value_bytes": f16, "resident_bytes": key_bytes + value_bytes,
                "compression_ratio": 2 * f16 / (key_bytes + value_bytes) if key_bytes + value_bytes else 0.0}
