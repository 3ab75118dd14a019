"""Whole-prefix coding of one layer's KV, on the CPU or a CUDA GPU
(kvcodec.h, "whole-prefix codec"; docs/python.md).

    codec = kvcodec.PrefixCodec(calibration, layer=3, max_tokens=8192, device="cuda")
    enc = codec.encode(keys, values)     # [B, H_kv, S, D] torch tensors on that GPU
    keys2, values2 = codec.decode(enc)   # bfloat16, on the same GPU
    enc.nbytes, enc.compression_ratio    # every stored byte (payload + offsets)

The format is the calibrated kvtc-gpu/4 one: the layer's calibrated basis
over its concatenated heads, RoPE removed from keys and re-applied on
decode, `sinks` and `window` tokens raw, the rest in rANS streams of 64
tokens. device="cpu" runs the reference implementation on CPU tensors and
writes the same bytes as the GPU (tested). Torch tensors only (the format is
bfloat16). A libkvcodec built without CUDA refuses device="cuda" with
KVCodecError(UNSUPPORTED); kvcodec.cuda_device_count() says beforehand.
"""
import ctypes

from . import _lib
from ._lib import KVCodecError
from ._device import cuda_device_count, on_device, resolve_device, stream_of
from .cache import Calibration

try:
    import torch
except ImportError:  # pragma: no cover - CI has torch
    torch = None


def _invalid(message):
    return KVCodecError(_lib.INVALID_ARGUMENT, message)


class EncodedPrefix:
    """A coded layer: payload (uint8) and offsets (int64 holding the u64
    stream offsets) as tensors on the codec's device, and their sizes."""

    def __init__(self, payload, offsets, tokens, batch, n_kv_heads, head_dim, first_position=0):
        self.payload, self.offsets = payload, offsets
        self.tokens, self.batch, self.n_kv_heads, self.head_dim = tokens, batch, n_kv_heads, head_dim
        self.first_position = first_position  # the position of the first token (RoPE)

    @property
    def nbytes(self):
        """Every stored byte: the payload and the stream offsets (8 bytes each)."""
        return int(self.payload.numel()) + 8 * int(self.offsets.numel())

    @property
    def fp16_bytes(self):
        """What f16 keys and values of these tokens take."""
        return 2 * self.batch * self.n_kv_heads * self.tokens * self.head_dim * 2

    @property
    def compression_ratio(self):
        return self.fp16_bytes / self.nbytes


class PrefixCodec:
    """Codes one layer's whole KV sequence (see the module's docstring).

    calibration: a kvcodec.Calibration or the path of a per-layer
    calibration (`kvcodec calibrate`); layer: its layer index; batch: rows B;
    max_tokens: the longest sequence S (sizes the RoPE tables and, on the
    GPU, the scratch); device: "cpu", "cuda" or "cuda:N" (a torch device);
    reconstruction: "exact" (bit-identical on CPU and GPU), "tf32" (GPU
    tensor cores, within the bound of docs/gpu.md) or "integer" (the CPU
    KVTC codec's integer reconstruction, bit-identical on CPU and GPU, on
    integer tensor cores there); the payload is the same for all three."""

    def __init__(self, calibration, layer, *, max_tokens, batch=1, sinks=4, window=128, device="cpu",
                 reconstruction="exact"):
        if torch is None:  # pragma: no cover
            raise KVCodecError(_lib.UNSUPPORTED, "PrefixCodec needs torch (its tensors are bfloat16)")
        if not isinstance(calibration, Calibration):
            calibration = Calibration(calibration)
        self.calibration = calibration  # kept alive: the codec reads its tables
        self.device = resolve_device(device)
        self.layer, self.batch, self.max_tokens = int(layer), int(batch), int(max_tokens)
        self.sinks, self.window = int(sinks), int(window)
        on_gpu = self.device.type == "cuda"
        if on_gpu and cuda_device_count()[1] and not torch.cuda.is_available():
            raise KVCodecError(_lib.UNSUPPORTED, "device cuda: torch sees no CUDA device")
        h = ctypes.c_void_p()
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_prefix_codec_create(calibration._h, self.layer, self.batch, self.max_tokens,
                                                            self.sinks, self.window, 1 if on_gpu else 0,
                                                            ctypes.byref(h)))
        self._h = h
        modes = {"exact": 0, "tf32": 1, "integer": 2}
        if reconstruction not in modes:
            raise _invalid(f"reconstruction {reconstruction!r} is not 'exact', 'tf32' or 'integer'")
        _lib.check(_lib.lib.kvcodec_prefix_codec_set_reconstruction(h, modes[reconstruction]))
        self.reconstruction = reconstruction

    def __del__(self):
        if getattr(self, "_h", None):
            _lib.lib.kvcodec_prefix_codec_free(self._h)
            self._h = None

    def _on_device(self):
        return on_device(self.device)

    def _stream(self):
        return stream_of(self.device)

    def _check_kv(self, keys, values):
        cal = self.calibration
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise _invalid(f"{name} must be a torch tensor, not {type(x).__name__}")
            if x.device != self.device:
                raise _invalid(f"{name} are on {x.device}, the codec on {self.device}")
            if not x.is_floating_point():
                raise _invalid(f"{name} dtype {x.dtype} is not a floating point type")
            want = (self.batch, cal.n_kv_heads, x.shape[2] if x.dim() == 4 else -1, cal.head_dim)
            if x.dim() != 4 or tuple(x.shape) != want:
                raise KVCodecError(_lib.SHAPE_MISMATCH,
                                   f"{name} have shape {tuple(x.shape)}: expected [B={self.batch}, "
                                   f"H_kv={cal.n_kv_heads}, S, D={cal.head_dim}]")
        if keys.shape != values.shape:
            raise KVCodecError(_lib.SHAPE_MISMATCH,
                               f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
        return int(keys.shape[2])

    def bounds(self, tokens):
        """(largest payload of `tokens` tokens, entries of its offsets)."""
        cap, n = ctypes.c_uint64(), ctypes.c_int64()
        _lib.check(_lib.lib.kvcodec_prefix_codec_bounds(self._h, int(tokens), ctypes.byref(cap), ctypes.byref(n)))
        return cap.value, n.value

    def encode(self, keys, values, first_position=0):
        """keys, values [B, H_kv, S, D] (any float dtype, on the codec's
        device; keys post-RoPE at positions first_position .. first_position
        + S - 1: a later block of a sequence is coded at its own position)
        -> EncodedPrefix. They are
        copied once on the device into the codec's layout [2, B, S, H_kv * D]
        bfloat16; the payload is trimmed to its size (a copy of it)."""
        S = self._check_kv(keys, values)
        cap, n_offsets = self.bounds(S)
        cal = self.calibration
        kv = torch.stack((keys, values)).to(torch.bfloat16).transpose(2, 3).contiguous()
        payload = torch.empty(cap, dtype=torch.uint8, device=self.device)
        offsets = torch.empty(n_offsets, dtype=torch.int64, device=self.device)
        written = ctypes.c_uint64()
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_prefix_encode(self._h, kv.data_ptr(), S, int(first_position),
                                                      payload.data_ptr(), cap, offsets.data_ptr(), self._stream(),
                                                      ctypes.byref(written)))
        return EncodedPrefix(payload[:written.value].clone(), offsets, S, self.batch, cal.n_kv_heads, cal.head_dim,
                             int(first_position))

    def decode(self, encoded, check=True):
        """EncodedPrefix -> (keys, values) [B, H_kv, S, D] bfloat16 on the
        codec's device (views of one [2, B, S, H_kv, D] buffer). On the GPU
        the decode is queued on the current stream; check=True waits for it
        and raises KVCodecError(FORMAT) for damaged streams (check=False: call
        self.check() later)."""
        if not isinstance(encoded, EncodedPrefix):
            raise _invalid(f"decode takes an EncodedPrefix, not {type(encoded).__name__}")
        cal = self.calibration
        if (encoded.batch, encoded.n_kv_heads, encoded.head_dim) != (self.batch, cal.n_kv_heads, cal.head_dim):
            raise KVCodecError(_lib.SHAPE_MISMATCH,
                               f"encoded prefix of B={encoded.batch}, H_kv={encoded.n_kv_heads}, "
                               f"D={encoded.head_dim}; the codec has B={self.batch}, H_kv={cal.n_kv_heads}, "
                               f"D={cal.head_dim}")
        for name, t in (("payload", encoded.payload), ("offsets", encoded.offsets)):
            if t.device != self.device or not t.is_contiguous():
                raise _invalid(f"encoded {name} is on {t.device} (contiguous: {t.is_contiguous()}); "
                               f"the codec decodes contiguous tensors on {self.device}")
        if encoded.payload.dtype != torch.uint8 or encoded.offsets.dtype != torch.int64:
            raise _invalid(f"encoded payload / offsets dtypes {encoded.payload.dtype} / {encoded.offsets.dtype} "
                           "are not uint8 / int64")
        S = int(encoded.tokens)
        _, n_offsets = self.bounds(S)
        if encoded.offsets.numel() != n_offsets:
            raise KVCodecError(_lib.FORMAT, f"encoded offsets has {encoded.offsets.numel()} entries; "
                                            f"{S} tokens need {n_offsets}")
        kv = torch.empty((2, self.batch, S, cal.n_kv_heads * cal.head_dim), dtype=torch.bfloat16, device=self.device)
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_prefix_decode(self._h, encoded.payload.data_ptr(), encoded.payload.numel(),
                                                      encoded.offsets.data_ptr(), S, int(encoded.first_position),
                                                      kv.data_ptr(), self._stream()))
        if check:
            self.check()
        kv = kv.view(2, self.batch, S, cal.n_kv_heads, cal.head_dim).transpose(2, 3)
        return kv[0], kv[1]

    def check(self):
        """Waits for the GPU's decodes and raises KVCodecError(FORMAT) naming
        the first damaged stream since the last check (no-op on the CPU)."""
        with self._on_device():
            _lib.check(_lib.lib.kvcodec_prefix_check(self._h, self._stream()))
