"""Per-layer compressed KV caches over the C API (include/kvcodec/kvcodec.h).

Keys and values are [B, H_kv, S, D] numpy arrays (float32, float16) or CPU
torch tensors (float32, float16, bfloat16), any strides: they are passed to
the library by pointer, without a copy. What comes back is allocated once in
the input's kind and dtype and filled by the library in place.

Tensors on a GPU: this libkvcodec codes on the host, so they are refused
unless the cache was made with host_round_trip=True; then append() copies
them to the host and update_and_fetch() copies the reconstruction back to
their device, every byte counted in host_copy_bytes (never a silent copy).
"""
import ctypes

import numpy as np

from . import _lib
from ._lib import KVCodecError
from ._layer_cache import StatsAttributes

try:  # torch is optional: numpy alone works
    import torch
except ImportError:  # pragma: no cover - CI has torch
    torch = None

_NP_DTYPES = {np.dtype(np.float32): _lib.F32, np.dtype(np.float16): _lib.F16}
_DTYPE_NAMES = {"f32": _lib.F32, "float32": _lib.F32, "f16": _lib.F16, "float16": _lib.F16,
                "bf16": _lib.BF16, "bfloat16": _lib.BF16}
if torch is not None:
    _TORCH_DTYPES = {torch.float32: _lib.F32, torch.float16: _lib.F16, torch.bfloat16: _lib.BF16}
    _TORCH_OF = {v: k for k, v in _TORCH_DTYPES.items()}


def _invalid(message):
    return KVCodecError(_lib.INVALID_ARGUMENT, message)


def settings_text(settings):
    """A dict {field: value} or a "field=value;field=value" string, as text."""
    if settings is None:
        return ""
    if isinstance(settings, str):
        return settings
    if isinstance(settings, dict):
        items = []
        for k, v in settings.items():
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, (list, tuple)):
                v = ",".join(str(x) for x in v)
            items.append(f"{k}={v}")
        return ";".join(items)
    raise _invalid(f"settings must be a str or a dict, not {type(settings).__name__}")


def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _as_c_tensor(x, name):
    """A kvcodec_tensor viewing x (no copy); raises KVCodecError naming x."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise KVCodecError(_lib.UNSUPPORTED,
                               f"{name} are on {x.device}: this libkvcodec has no GPU codec; pass CPU tensors "
                               f"({name}.cpu()) or make the cache with host_round_trip=True (counted copies) "
                               f"- kvcodec never copies them silently")
        if x.dtype not in _TORCH_DTYPES:
            raise _invalid(f"{name} dtype {x.dtype} is not torch.float32, torch.float16 or torch.bfloat16")
        if x.dim() != 4:
            raise _invalid(f"{name} has shape {tuple(x.shape)}: expected 4 dims [B, H_kv, S, D]")
        dtype, shape, strides, ptr = _TORCH_DTYPES[x.dtype], tuple(x.shape), tuple(x.stride()), x.data_ptr()
    elif isinstance(x, np.ndarray):
        if x.dtype not in _NP_DTYPES:
            raise _invalid(f"{name} dtype {x.dtype} is not float32 or float16 (bfloat16: pass a torch tensor)")
        if x.ndim != 4:
            raise _invalid(f"{name} has shape {x.shape}: expected 4 dims [B, H_kv, S, D]")
        if any(s % x.itemsize for s in x.strides):
            raise _invalid(f"{name} strides {x.strides} are not whole elements")
        dtype, shape, ptr = _NP_DTYPES[x.dtype], x.shape, x.ctypes.data
        strides = tuple(s // x.itemsize for s in x.strides)
    else:
        raise _invalid(f"{name} must be a numpy array or a torch tensor, not {type(x).__name__}")
    t = _lib.Tensor()
    t.data = ptr
    t.dtype = dtype
    t.shape[:] = shape
    if any(n == 0 for n in shape):
        strides = (0, 0, 0, 0)  # empty: any strides do; all 0 reads as contiguous
    t.strides[:] = strides
    return t


def _dtype_code(dtype):
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    if torch is not None and isinstance(dtype, torch.dtype) and dtype in _TORCH_DTYPES:
        return _TORCH_DTYPES[dtype]
    try:
        if np.dtype(dtype) in _NP_DTYPES:
            return _NP_DTYPES[np.dtype(dtype)]
    except TypeError:
        pass
    raise _invalid(f"dtype {dtype!r} is not f32, f16 or bf16")


class Calibration:
    """A calibration file of `kvcodec calibrate`, loaded once and shared by
    every calibrated kvtc cache made with it."""

    def __init__(self, path):
        h = ctypes.c_void_p()
        _lib.check(_lib.lib.kvcodec_calibration_load(str(path).encode(), ctypes.byref(h)))
        self._h = h
        n_layers, heads, dim = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        theta, params = ctypes.c_double(), ctypes.c_uint64()
        _lib.check(_lib.lib.kvcodec_calibration_info(h, ctypes.byref(n_layers), ctypes.byref(heads),
                                                     ctypes.byref(dim), ctypes.byref(theta), ctypes.byref(params)))
        self.path = str(path)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers.value, heads.value, dim.value
        self.rope_theta, self.params_bytes = theta.value, params.value

    def __del__(self):
        if getattr(self, "_h", None):
            _lib.lib.kvcodec_calibration_free(self._h)
            self._h = None


class Cache(StatsAttributes):
    """One transformer layer's compressed KV cache.

    Cache("kvtc", "mode=local;block=64", n_kv_heads=2, head_dim=64) or with
    settings as a dict. The surface of the mlx_lm-style caches this project
    grew from: update_and_fetch, offset, size(), state, trim, is_trimmable,
    save/load and the byte counters.
    """

    def __init__(self, method, settings=None, *, n_kv_heads, head_dim, layer=0, n_layers=1, rope_theta=10000.0,
                 calibration=None, host_round_trip=False):
        if calibration is not None and not isinstance(calibration, Calibration):
            calibration = Calibration(calibration)
        cfg = _lib.CacheConfig(int(layer), int(n_layers), int(n_kv_heads), int(head_dim), float(rope_theta))
        h = ctypes.c_void_p()
        _lib.check(_lib.lib.kvcodec_cache_create(str(method).encode(), settings_text(settings).encode(),
                                                 ctypes.byref(cfg), calibration._h if calibration else None,
                                                 ctypes.byref(h)))
        self._h = h
        self.calibration = calibration
        self._init_round_trip(host_round_trip)

    def _init_round_trip(self, allowed):
        # host_round_trip: GPU tensors are copied to the host and back, and counted.
        self.host_round_trip = bool(allowed)
        self.host_copy_bytes = 0  # bytes copied device -> host and host -> device

    def _on_host(self, x, name):
        """x itself, or with host_round_trip its host copy (counted)."""
        if not (_is_torch(x) and x.device.type != "cpu" and self.host_round_trip):
            return x
        h = x.detach().to("cpu")
        self.host_copy_bytes += h.numel() * h.element_size()
        return h

    @classmethod
    def load(cls, data):
        """A cache restored from save() bytes (damaged bytes raise KVCodecError)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise _invalid(f"load() takes bytes, not {type(data).__name__}")
        data = bytes(data)
        h = ctypes.c_void_p()
        _lib.check(_lib.lib.kvcodec_cache_load(data, len(data), ctypes.byref(h)))
        self = cls.__new__(cls)
        self._h = h
        self.calibration = None
        self._init_round_trip(False)
        return self

    @classmethod
    def merge(cls, caches):
        """Batched merging (one cache from several sequences) is refused."""
        raise KVCodecError(_lib.UNSUPPORTED, "kvcodec caches do not merge into a batch: a cache holds one batch "
                                             "as it was appended; make one cache per sequence")

    def __del__(self):
        if getattr(self, "_h", None):
            _lib.lib.kvcodec_cache_free(self._h)
            self._h = None

    # --- what it holds -------------------------------------------------------

    @property
    def method(self):
        return _lib.lib.kvcodec_cache_method(self._h).decode()

    @property
    def config(self):
        c = _lib.CacheConfig()
        _lib.check(_lib.lib.kvcodec_cache_get_config(self._h, ctypes.byref(c)))
        return {"layer": c.layer, "n_layers": c.n_layers, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                "rope_theta": c.rope_theta}

    @property
    def offset(self):
        n = ctypes.c_int64()
        _lib.check(_lib.lib.kvcodec_cache_offset(self._h, ctypes.byref(n)))
        return n.value

    def size(self):
        return self.offset

    @property
    def shape(self):
        s = (ctypes.c_int64 * 4)()
        _lib.check(_lib.lib.kvcodec_cache_shape(self._h, s))
        return tuple(s)

    # --- appending and reading -------------------------------------------------

    def append(self, keys, values):
        if _is_torch(keys) and _is_torch(values) and keys.device != values.device:
            raise _invalid(f"keys are on {keys.device}, values on {values.device}: expected one device")
        keys, values = self._on_host(keys, "keys"), self._on_host(values, "values")
        k, v = _as_c_tensor(keys, "keys"), _as_c_tensor(values, "values")
        _lib.check(_lib.lib.kvcodec_cache_append(self._h, ctypes.byref(k), ctypes.byref(v)))

    def fetch(self, dtype="f32", kind="numpy"):
        """The reconstructed history [B, H_kv, S_total, D] as two new arrays
        ("numpy") or tensors ("torch") of dtype."""
        code = _dtype_code(dtype)
        shape = self.shape
        if kind == "torch":
            if torch is None:
                raise _invalid("kind='torch' needs torch")
            k, v = (torch.empty(shape, dtype=_TORCH_OF[code]) for _ in range(2))
            pk, pv, nbytes = k.data_ptr(), v.data_ptr(), k.numel() * k.element_size()
        elif kind == "numpy":
            if code == _lib.BF16:
                raise _invalid("numpy has no bfloat16: fetch(dtype='bf16', kind='torch')")
            np_dtype = np.float32 if code == _lib.F32 else np.float16
            k, v = np.empty(shape, np_dtype), np.empty(shape, np_dtype)
            pk, pv, nbytes = k.ctypes.data, v.ctypes.data, k.nbytes
        else:
            raise _invalid(f"kind {kind!r} is not 'numpy' or 'torch'")
        _lib.check(_lib.lib.kvcodec_cache_fetch(self._h, code, pk, pv, nbytes))
        return k, v

    def update_and_fetch(self, keys, values):
        """append() then the whole history in the input's kind, dtype and
        device (a GPU device only with host_round_trip: copied back, counted)."""
        self.append(keys, values)
        if _is_torch(keys):
            k, v = self.fetch(keys.dtype, kind="torch")
            if keys.device.type != "cpu":
                self.host_copy_bytes += 2 * k.numel() * k.element_size()
                k, v = k.to(keys.device), v.to(keys.device)
            return k, v
        return self.fetch(keys.dtype, kind="numpy")

    def for_each_block(self, visit):
        """visit(first_token, keys, values) with f32 numpy views [B, H_kv, n, D]
        of the history in order, valid during the call only. visit returning
        True stops the walk."""
        failure = []

        def trampoline(_user, first, kp, vp):
            try:
                arrays = []
                for t in (kp.contents, vp.contents):
                    shape, strides = tuple(t.shape), tuple(s * 4 for s in t.strides)
                    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
                    buf = (ctypes.c_float * span).from_address(t.data) if span else None
                    base = np.frombuffer(buf, np.float32) if span else np.empty(0, np.float32)
                    arrays.append(np.lib.stride_tricks.as_strided(base, shape, strides, writeable=False))
                return 1 if visit(first, arrays[0], arrays[1]) else 0
            except BaseException as e:  # re-raised once the C call has returned
                failure.append(e)
                return 1

        cb = _lib.BLOCK_VISITOR(trampoline)
        _lib.check(_lib.lib.kvcodec_cache_visit(self._h, cb, None))
        if failure:
            raise failure[0]

    # --- trim, save, load ----------------------------------------------------------

    def is_trimmable(self):
        out = ctypes.c_int()
        _lib.check(_lib.lib.kvcodec_cache_is_trimmable(self._h, ctypes.byref(out)))
        return bool(out.value)

    def trim(self, n):
        """Drops the n newest tokens; returns how many were dropped."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise _invalid(f"trim() takes an int, not {type(n).__name__}")
        dropped = ctypes.c_int64()
        _lib.check(_lib.lib.kvcodec_cache_trim(self._h, n, ctypes.byref(dropped)))
        return dropped.value

    def save(self):
        """The full compressed state as bytes (a checksummed container)."""
        n = ctypes.c_size_t()
        _lib.check(_lib.lib.kvcodec_cache_save_size(self._h, ctypes.byref(n)))
        buf = ctypes.create_string_buffer(n.value)
        written = ctypes.c_size_t()
        _lib.check(_lib.lib.kvcodec_cache_save(self._h, buf, n.value, ctypes.byref(written)))
        return buf.raw[:written.value]

    @property
    def state(self):
        """The compressed state (save()'s bytes); assigning bytes restores one."""
        return self.save()

    @state.setter
    def state(self, data):
        other = Cache.load(data)
        self.__del__()
        self._h, other._h = other._h, None

    # --- telemetry -------------------------------------------------------------------

    def stats(self):
        s = _lib.Stats()
        _lib.check(_lib.lib.kvcodec_cache_stats(self._h, ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _lib.Stats._fields_}

    @property
    def extras(self):
        """Method extras {name: value} ("key.n_survived.0", "calibration_bytes", ...)."""
        out = {}

        def add(_user, name, value):
            out[name.decode()] = value
            return 0

        _lib.check(_lib.lib.kvcodec_cache_extras(self._h, _lib.EXTRA_VISITOR(add), None))
        return out

    # Memory shared with other caches (kvcodec.h, kvcodec_stats); the other
    # stats fields are attributes through StatsAttributes.
    shared_bytes = property(lambda self: self.stats()["shared_bytes"])
