"""kvcodec: compressed KV caches (KVTC, PALU, baselines) for numpy, PyTorch
and Hugging Face transformers, over libkvcodec.so's C API.

    import kvcodec
    cache = kvcodec.Cache("kvtc", {"mode": "local"}, n_kv_heads=8, head_dim=128)
    k, v = cache.update_and_fetch(keys, values)   # [B, H_kv, S, D] in, whole history out
    cache.compressed_key_bytes, cache.fp16_key_bytes

kvcodec.hf.KVCodecCache is a transformers Cache made of these;
kvcodec.PrefixCodec codes a layer's whole prefix at once, and
kvcodec.PaluCodec a palu cache's head group, on the CPU or a CUDA GPU
(torch tensors in and out); kvcodec.BlockCache (calibrated kvtc) and
kvcodec.PaluBlockCache (palu) keep a layer compressed on that device.
"""
from ._lib import KVCodecError, lib as _clib, path as library_path
from .cache import Cache, Calibration
from ._device import cuda_device_count
from .prefix import EncodedPrefix, PrefixCodec
from .palu_codec import PaluCodec
from .block_cache import BlockCache
from .palu_block_cache import PaluBlockCache

__all__ = ["BlockCache", "Cache", "Calibration", "EncodedPrefix", "KVCodecError", "PaluBlockCache", "PaluCodec",
           "PrefixCodec", "cuda_device_count", "methods", "version", "library_path"]


def version():
    """The loaded libkvcodec.so's version ("0.1.0")."""
    return _clib.kvcodec_version().decode()


def methods():
    """Every cache method the library has: ["fp16", "int8", ...]."""
    out, i = [], 0
    while True:
        name = _clib.kvcodec_method_name(i)
        if name is None:
            return out
        out.append(name.decode())
        i += 1


__version__ = version()
