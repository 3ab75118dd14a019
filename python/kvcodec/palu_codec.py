"""PALU latents of one head group coded outside the cache, on the CPU or a
CUDA GPU, with the projection a palu cache fitted (kvcodec.h, "PALU latent
codec"; docs/python.md).

    cache = kvcodec.Cache("palu", "n_head_groups=2", n_kv_heads=8, head_dim=128)
    cache.append(keys, values)         # fits the projections (min_fit_tokens)
    codec = kvcodec.PaluCodec(cache, "keys", head_group=0, max_tokens=8192, device="cuda")
    packed = codec.encode(keys_gpu)    # [B, H_kv, S, D] -> uint8 [S / group_size, group_bytes], on the GPU
    heads = codec.decode(packed)       # [B, n_heads, S, D] bfloat16: heads first_head .. of the group

The packed bytes are the cache's own token groups for those tokens
(palu::encode_latent_group) and decode is the cache's reconstruction;
device="cpu" runs the CPU reference on CPU tensors and writes the same
bytes as the GPU (tested). Torch tensors only (the codec codes bfloat16).
A libkvcodec built without CUDA refuses device="cuda" with
KVCodecError(UNSUPPORTED); kvcodec.cuda_device_count() says beforehand.
"""
import ctypes

from . import _lib
from ._lib import KVCodecError
from .cache import Cache
from ._device import cuda_device_count, on_device, resolve_device, stream_of

try:
    import torch
except ImportError:  # pragma: no cover - CI has torch
    torch = None

_PARTS = {"keys": 0, "values": 1}
_LAYOUT_FIELDS = ("first_head", "n_heads", "joint", "rows", "dim", "rank", "group_size", "keys_without_rope",
                  "first_token", "max_tokens", "group_bytes")


def _invalid(message):
    return KVCodecError(_lib.INVALID_ARGUMENT, message)


class PaluCodec:
    """Codes one head group of a palu cache's keys or values (see the
    module's docstring).

    cache: a kvcodec.Cache of method "palu" that has fitted its projections;
    part: "keys" or "values"; head_group: its index (see head_groups());
    max_tokens: the most tokens one call takes; device: "cpu", "cuda" or
    "cuda:N". The codec copies the projection: the cache may change after.
    Attributes: first_head, n_heads, joint, rows, dim, rank, group_size,
    group_bytes, first_token, keys_without_rope (kvcodec.h's
    kvcodec_palu_layout), batch, head_dim."""

    def __init__(self, cache, part, head_group=0, *, max_tokens, device="cpu"):
        if torch is None:  # pragma: no cover
            raise KVCodecError(_lib.UNSUPPORTED, "PaluCodec needs torch (its tensors are bfloat16)")
        if not isinstance(cache, Cache):
            raise _invalid(f"cache must be a kvcodec.Cache, not {type(cache).__name__}")
        if part not in _PARTS:
            raise _invalid(f"part {part!r} is not 'keys' or 'values'")
        self.device = resolve_device(device)
        on_gpu = self.device.type == "cuda"
        if on_gpu and cuda_device_count()[1] and not torch.cuda.is_available():
            raise KVCodecError(_lib.UNSUPPORTED, "device cuda: torch sees no CUDA device")
        self.part, self.head_group = part, int(head_group)
        h = ctypes.c_void_p()
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_palu_codec_create(cache._h, _PARTS[part], self.head_group, int(max_tokens),
                                                          1 if on_gpu else 0, ctypes.byref(h)))
        self._h = h
        layout = _lib.PaluLayout()
        _lib.check(_lib.lib.kvcodec_palu_codec_layout(h, ctypes.byref(layout)))
        for name in _LAYOUT_FIELDS:
            setattr(self, name, getattr(layout, name))
        self.joint, self.keys_without_rope = bool(self.joint), bool(self.keys_without_rope)
        self.n_kv_heads, self.head_dim = cache.config["n_kv_heads"], cache.config["head_dim"]
        self.batch = self.rows if self.joint else self.rows // self.n_heads

    @staticmethod
    def head_groups(cache):
        """Head groups of a fitted palu cache's keys (and values)."""
        n = ctypes.c_int32()
        _lib.check(_lib.lib.kvcodec_palu_head_groups(cache._h if isinstance(cache, Cache) else None,
                                                     ctypes.byref(n)))
        return n.value

    def __del__(self):
        if getattr(self, "_h", None):
            _lib.lib.kvcodec_palu_codec_free(self._h)
            self._h = None

    def _on_device(self):
        return on_device(self.device)

    def _stream(self):
        return stream_of(self.device)

    def _check_tensor(self, x, name):
        if not isinstance(x, torch.Tensor):
            raise _invalid(f"{name} must be a torch tensor, not {type(x).__name__}")
        if x.device != self.device:
            raise _invalid(f"{name} is on {x.device}, the codec on {self.device}")

    def encode(self, x):
        """x [B, H_kv, S, D] (the layer's keys or values; or [B, n_heads, S,
        D], the group's heads alone), any float dtype, on the codec's device,
        S a multiple of group_size -> uint8 [S / group_size, group_bytes] on
        the same device. The group's heads are copied once there into the
        codec's layout [rows, S, dim] bfloat16; on the GPU the encode is
        queued on the current stream."""
        self._check_tensor(x, "x")
        if not x.is_floating_point():
            raise _invalid(f"x dtype {x.dtype} is not a floating point type")
        if x.dim() != 4 or x.shape[0] != self.batch or x.shape[1] not in (self.n_kv_heads, self.n_heads) \
                or x.shape[3] != self.head_dim:
            raise KVCodecError(_lib.SHAPE_MISMATCH,
                               f"x has shape {tuple(x.shape)}: expected [B={self.batch}, H_kv={self.n_kv_heads} "
                               f"(or the group's {self.n_heads}), S, D={self.head_dim}]")
        if x.shape[1] != self.n_heads:
            x = x[:, self.first_head:self.first_head + self.n_heads]
        S = int(x.shape[2])
        # Shared: [B, n, S, D] is [rows, S, D]; joint: a token's heads side by side.
        rows = (x.transpose(1, 2) if self.joint else x).to(torch.bfloat16).contiguous()
        n_bytes = (S // self.group_size) * self.group_bytes if S > 0 else 0
        packed = torch.empty((max(S // self.group_size, 0), self.group_bytes), dtype=torch.uint8, device=self.device)
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_palu_encode(self._h, rows.data_ptr(), S, packed.data_ptr(), n_bytes,
                                                    self._stream()))
        return packed

    def decode(self, packed):
        """uint8 [G, group_bytes] (encode's output) -> [B, n_heads, G *
        group_size, D] bfloat16 on the codec's device: the group's heads, as
        the cache reconstructs them (on the GPU queued on the current
        stream)."""
        self._check_tensor(packed, "packed")
        if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
            raise _invalid(f"packed is {packed.dtype} of shape {tuple(packed.shape)} (contiguous: "
                           f"{packed.is_contiguous()}); expected contiguous uint8 [token groups, group_bytes]")
        S = int(packed.shape[0]) * self.group_size
        y = torch.empty((self.rows, S, self.dim), dtype=torch.bfloat16, device=self.device)
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_palu_decode(self._h, packed.data_ptr(), packed.numel(), S, y.data_ptr(),
                                                    self._stream()))
        if self.joint:
            return y.view(self.batch, S, self.n_heads, self.head_dim).transpose(1, 2)
        return y.view(self.batch, self.n_heads, S, self.head_dim)
