"""Where the codecs' torch tensors live: the device argument every GPU-capable
class takes ("cpu", "cuda", "cuda:N"), the context that makes a CUDA device
current for a C call, and the stream the call is queued on."""
import ctypes

from . import _lib
from ._lib import KVCodecError

try:
    import torch
except ImportError:  # pragma: no cover - CI has torch
    torch = None


def cuda_device_count():
    """(devices this libkvcodec can use, whether it was built with CUDA)."""
    compiled = ctypes.c_int()
    n = _lib.lib.kvcodec_cuda_device_count(ctypes.byref(compiled))
    return n, bool(compiled.value)


def resolve_device(device):
    """torch.device of the CPU or a CUDA device with its index (tensors name
    their device with it), or KVCodecError(INVALID_ARGUMENT) naming the
    argument."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise KVCodecError(_lib.INVALID_ARGUMENT, f"device {device!r} is not a torch device: {e}") from None
    if d.type not in ("cpu", "cuda"):
        raise KVCodecError(_lib.INVALID_ARGUMENT, f"device {d} is neither the CPU nor a CUDA device")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def on_device(device):
    """A context making `device` current for a C call (nothing on the CPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device(device)
    return _NoContext()


def stream_of(device):
    """The cudaStream_t of `device`'s current torch stream; None on the CPU."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
