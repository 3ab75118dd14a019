"""ctypes bindings of include/kvcodec/kvcodec.h (ABI mode: one build of
libkvcodec.so serves every Python version).

The library is looked up, in order: $KVCODEC_LIBRARY (a path), the copy
bundled in this package at install time, then the system's (ldconfig).
"""
import ctypes
import ctypes.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


class KVCodecError(RuntimeError):
    """A failing kvcodec call: .status is the C API's number (kvcodec.h),
    .status_name its name, and the message says what was wrong."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.status_name = STATUS_NAMES.get(status, "unknown error")


# kvcodec_status (stable numbers, kvcodec.h).
OK = 0
INVALID_ARGUMENT, CONFIG, FORMAT, CHECKSUM, IO, UNSUPPORTED, SHAPE_MISMATCH, NOT_FOUND, INTERNAL = range(1, 10)
BUFFER_TOO_SMALL, OUT_OF_MEMORY = 100, 101
STATUS_NAMES = {}

F32, F16, BF16 = 0, 1, 2


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4)]


class CacheConfig(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_int32), ("n_layers", ctypes.c_int32), ("n_kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("rope_theta", ctypes.c_double)]


class Stats(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("compressed_key_bytes", ctypes.c_uint64),
                ("compressed_value_bytes", ctypes.c_uint64), ("fp16_key_bytes", ctypes.c_uint64),
                ("fp16_value_bytes", ctypes.c_uint64), ("resident_bytes", ctypes.c_uint64),
                ("shared_bytes", ctypes.c_uint64), ("compression_ratio", ctypes.c_double)]


class PaluLayout(ctypes.Structure):
    _fields_ = [("first_head", ctypes.c_int32), ("n_heads", ctypes.c_int32), ("joint", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("dim", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("group_size", ctypes.c_int32), ("keys_without_rope", ctypes.c_int32), ("first_token", ctypes.c_int64),
                ("max_tokens", ctypes.c_int64), ("group_bytes", ctypes.c_uint64)]


BLOCK_VISITOR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(Tensor),
                                 ctypes.POINTER(Tensor))
EXTRA_VISITOR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_double)


def _find_library():
    env = os.environ.get("KVCODEC_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"KVCODEC_LIBRARY={env} is not a file")
        return env
    bundled = os.path.join(_HERE, "libkvcodec.so")
    if os.path.isfile(bundled):
        return bundled
    found = ctypes.util.find_library("kvcodec")
    if found:
        return found
    raise ImportError("libkvcodec.so not found: not bundled in " + _HERE +
                      ", not installed system-wide; set KVCODEC_LIBRARY to its path")


lib = ctypes.CDLL(_find_library())
path = lib._name

_c = ctypes
_P = ctypes.c_void_p
_status = ctypes.c_int
_signatures = {
    "kvcodec_version": (_c.c_char_p, []),
    "kvcodec_version_number": (_c.c_uint, []),
    "kvcodec_status_name": (_c.c_char_p, [_c.c_int]),
    "kvcodec_last_error": (_c.c_char_p, []),
    "kvcodec_dtype_size": (_c.c_size_t, [_c.c_int]),
    "kvcodec_method_name": (_c.c_char_p, [_c.c_size_t]),
    "kvcodec_calibration_load": (_status, [_c.c_char_p, _c.POINTER(_P)]),
    "kvcodec_calibration_free": (None, [_P]),
    "kvcodec_calibration_info": (_status, [_P, _c.POINTER(_c.c_int32), _c.POINTER(_c.c_int32),
                                           _c.POINTER(_c.c_int32), _c.POINTER(_c.c_double),
                                           _c.POINTER(_c.c_uint64)]),
    "kvcodec_cache_create": (_status, [_c.c_char_p, _c.c_char_p, _c.POINTER(CacheConfig), _P, _c.POINTER(_P)]),
    "kvcodec_cache_load": (_status, [_c.c_char_p, _c.c_size_t, _c.POINTER(_P)]),
    "kvcodec_cache_free": (None, [_P]),
    "kvcodec_cache_method": (_c.c_char_p, [_P]),
    "kvcodec_cache_get_config": (_status, [_P, _c.POINTER(CacheConfig)]),
    "kvcodec_cache_append": (_status, [_P, _c.POINTER(Tensor), _c.POINTER(Tensor)]),
    "kvcodec_cache_offset": (_status, [_P, _c.POINTER(_c.c_int64)]),
    "kvcodec_cache_shape": (_status, [_P, _c.POINTER(_c.c_int64)]),
    "kvcodec_cache_fetch_size": (_status, [_P, _c.c_int, _c.POINTER(_c.c_size_t)]),
    "kvcodec_cache_fetch": (_status, [_P, _c.c_int, _P, _P, _c.c_size_t]),
    "kvcodec_cache_visit": (_status, [_P, BLOCK_VISITOR, _P]),
    "kvcodec_cache_is_trimmable": (_status, [_P, _c.POINTER(_c.c_int)]),
    "kvcodec_cache_trim": (_status, [_P, _c.c_int64, _c.POINTER(_c.c_int64)]),
    "kvcodec_cache_save_size": (_status, [_P, _c.POINTER(_c.c_size_t)]),
    "kvcodec_cache_save": (_status, [_P, _P, _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "kvcodec_cache_stats": (_status, [_P, _c.POINTER(Stats)]),
    "kvcodec_cache_extras": (_status, [_P, EXTRA_VISITOR, _P]),
    "kvcodec_cuda_device_count": (_c.c_int, [_c.POINTER(_c.c_int)]),
    "kvcodec_prefix_codec_create": (_status, [_P, _c.c_int32, _c.c_int32, _c.c_int64, _c.c_int32, _c.c_int32,
                                              _c.c_int32, _c.POINTER(_P)]),
    "kvcodec_prefix_codec_free": (None, [_P]),
    "kvcodec_prefix_codec_set_reconstruction": (_status, [_P, _c.c_int32]),
    "kvcodec_prefix_codec_bounds": (_status, [_P, _c.c_int64, _c.POINTER(_c.c_uint64), _c.POINTER(_c.c_int64)]),
    "kvcodec_prefix_encode": (_status, [_P, _P, _c.c_int64, _c.c_int64, _P, _c.c_uint64, _P, _P,
                                        _c.POINTER(_c.c_uint64)]),
    "kvcodec_prefix_decode": (_status, [_P, _P, _c.c_uint64, _P, _c.c_int64, _c.c_int64, _P, _P]),
    "kvcodec_prefix_check": (_status, [_P, _P]),
    "kvcodec_palu_head_groups": (_status, [_P, _c.POINTER(_c.c_int32)]),
    "kvcodec_palu_codec_create": (_status, [_P, _c.c_int32, _c.c_int32, _c.c_int64, _c.c_int32, _c.POINTER(_P)]),
    "kvcodec_palu_codec_free": (None, [_P]),
    "kvcodec_palu_codec_layout": (_status, [_P, _c.POINTER(PaluLayout)]),
    "kvcodec_palu_encode": (_status, [_P, _P, _c.c_int64, _P, _c.c_uint64, _P]),
    "kvcodec_palu_decode": (_status, [_P, _P, _c.c_uint64, _c.c_int64, _P, _P]),
}
for _name, (_res, _args) in _signatures.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args

for _s in list(range(0, 10)) + [BUFFER_TOO_SMALL, OUT_OF_MEMORY]:
    STATUS_NAMES[_s] = lib.kvcodec_status_name(_s).decode()


def check(status):
    """Raises KVCodecError with the library's message when status is not OK."""
    if status != OK:
        raise KVCodecError(status, lib.kvcodec_last_error().decode(errors="replace"))
