"""KVCodecCache: a Hugging Face transformers Cache whose layers are kvcodec
caches, for model(...) and model.generate(..., past_key_values=...).

It implements what transformers 4.4x and 5.x call on a cache during a
forward pass and generate(): update(key_states, value_states, layer_idx,
cache_kwargs), get_seq_length, get_mask_sizes, get_query_offset, get_max_cache_shape /
get_max_length, crop, reset, len(), is_compileable, is_sliding. Beam
search and batch reshuffling (reorder_cache, batch_repeat_interleave with
repeats > 1, batch_select_indices) are refused with an error: a compressed
cache cannot be re-batched in place.

Keys arrive post-RoPE [B, H_kv, q_len, D]; update() appends them and
returns the whole reconstructed history in the input dtype, as DynamicCache
does. Without transformers installed the class still works (it then
derives from object), so the adapter can be tested against generate()'s
calls alone.
"""
from . import _lib
from ._lib import KVCodecError
from .block_cache import BlockCache
from .cache import Cache, Calibration
from .palu_block_cache import PaluBlockCache

try:
    from transformers.cache_utils import Cache as _HFCache
except Exception:  # transformers is optional (not in Debian)
    _HFCache = object


class KVCodecCache(_HFCache):
    """KVCodecCache("kvtc", settings="mode=local", calibration=None, config=None,
    host_round_trip=False).

    config: the model's config (num_hidden_layers, rope_theta); without it
    the layer count comes from the calibration, else from the highest layer
    seen (calibrated kvtc needs the true count: pass config or calibration).
    host_round_trip: accept a model on a GPU; each layer's new keys and
    values are copied to the host and its reconstruction back every step,
    counted in host_copy_bytes (kvcodec.Cache).
    """

    is_compileable = False

    def __init__(self, method="kvtc", settings=None, calibration=None, config=None, rope_theta=None,
                 host_round_trip=False):
        self.method = method
        self.host_round_trip = host_round_trip
        self.settings = settings
        if calibration is not None and not isinstance(calibration, Calibration):
            calibration = Calibration(calibration)
        self.calibration = calibration
        self.n_layers = getattr(config, "num_hidden_layers", None) or (calibration.n_layers if calibration else None)
        theta = rope_theta if rope_theta is not None else getattr(config, "rope_theta", None)
        if theta is None:  # transformers 5.x keeps it in rope_parameters
            theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
        if theta is None and calibration is not None:
            theta = calibration.rope_theta
        self.rope_theta = float(theta) if theta is not None else 10000.0
        self.caches = []  # layer i's kvcodec Cache, made at its first update()

    # --- the calls a forward pass makes ----------------------------------------

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        while len(self.caches) <= layer_idx:
            self.caches.append(None)
        cache = self.caches[layer_idx]
        if cache is None:
            if key_states.dim() != 4:
                raise KVCodecError(_lib.INVALID_ARGUMENT,
                                   f"key_states has shape {tuple(key_states.shape)}: expected [B, H_kv, q_len, D]")
            cache = self.caches[layer_idx] = self._make_layer(key_states, layer_idx)
        return cache.update_and_fetch(key_states, value_states)

    def _make_layer(self, key_states, layer_idx):
        """Layer layer_idx's cache, made at its first update() (key_states [B, H_kv, q_len, D])."""
        n_layers = self.n_layers or max(layer_idx + 1, 1)
        return Cache(self.method, self.settings, n_kv_heads=key_states.shape[1], head_dim=key_states.shape[3],
                     layer=layer_idx, n_layers=n_layers, rope_theta=self.rope_theta, calibration=self.calibration,
                     host_round_trip=self.host_round_trip)

    def get_seq_length(self, layer_idx=0):
        if layer_idx is None:
            layer_idx = 0
        if layer_idx >= len(self.caches) or self.caches[layer_idx] is None:
            return 0
        return self.caches[layer_idx].offset

    def get_mask_sizes(self, query, layer_idx=0):
        # Called before update(): the keys will then be the held tokens plus
        # the query's. transformers 5.x passes the query length, 4.x the
        # query's cache_position.
        q_len = query.shape[0] if getattr(query, "ndim", 0) else int(query)
        return self.get_seq_length(layer_idx) + q_len, 0

    def get_query_offset(self, layer_idx=0):  # transformers 5.x: the query's first position
        return self.get_seq_length(layer_idx)

    def get_max_cache_shape(self, layer_idx=0):
        return -1  # grows without bound

    def get_max_length(self):  # transformers 4.4x name
        return None

    def get_usable_length(self, new_seq_length, layer_idx=0):  # older 4.x
        return self.get_seq_length(layer_idx)

    @property
    def seen_tokens(self):
        return self.get_seq_length(0)

    @property
    def is_sliding(self):
        return [False] * max(len(self.caches), self.n_layers or 0)

    def __len__(self):
        return len(self.caches)

    # --- what generate() may do between steps --------------------------------------

    def crop(self, max_length):
        """Keeps the first max_length tokens (negative: drops -max_length)."""
        for cache in self.caches:
            if cache is None:
                continue
            keep = max_length if max_length >= 0 else cache.offset + max_length
            if cache.offset > keep:
                cache.trim(cache.offset - max(keep, 0))

    def reset(self):
        self.caches = []

    def reorder_cache(self, beam_idx):
        raise KVCodecError(_lib.UNSUPPORTED, "KVCodecCache does not reorder its batch (beam search): "
                                             "use num_beams=1, one cache per sequence")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1:
            raise KVCodecError(_lib.UNSUPPORTED, f"KVCodecCache cannot repeat its batch x{repeats}: "
                                                 "one cache per sequence (num_return_sequences=1, num_beams=1)")

    def batch_select_indices(self, indices):
        raise KVCodecError(_lib.UNSUPPORTED, "KVCodecCache cannot select batch rows: one cache per sequence")

    # --- kvcodec's own --------------------------------------------------------------

    def _sum(self, field):
        return sum(c.stats()[field] for c in self.caches if c is not None)

    compressed_key_bytes = property(lambda self: self._sum("compressed_key_bytes"))
    compressed_value_bytes = property(lambda self: self._sum("compressed_value_bytes"))
    fp16_key_bytes = property(lambda self: self._sum("fp16_key_bytes"))
    fp16_value_bytes = property(lambda self: self._sum("fp16_value_bytes"))
    resident_bytes = property(lambda self: self._sum("resident_bytes"))
    host_copy_bytes = property(lambda self: sum(c.host_copy_bytes for c in self.caches if c is not None))

    @property
    def compression_ratio(self):
        compressed = self.compressed_key_bytes + self.compressed_value_bytes
        return (self.fp16_key_bytes + self.fp16_value_bytes) / compressed if compressed else 0.0


class KVCodecGpuCache(KVCodecCache):
    """KVCodecGpuCache(calibration, max_tokens, config=None, sinks=4,
    window=32, block=256, reconstruction="exact"), or
    KVCodecGpuCache(max_tokens=N, method="palu", settings=...).

    The same transformers Cache, whose layers stay compressed on the device
    the model's keys and values are on: with a CUDA build of libkvcodec and
    a model on the GPU, the history is kept compressed in GPU memory and
    each update() decodes the layer on the GPU into the history it returns
    (attention's transient input). method "kvtc" (calibrated): layers are
    kvcodec.BlockCache (blocks coded once at their positions; calibration:
    a per-layer calibration of this model; sinks, window, block,
    reconstruction are theirs), nothing crosses to the host. method "palu":
    layers are kvcodec.PaluBlockCache (settings: palu's), which copy their
    first tokens to the host once for the fit (host_copy_bytes) and
    nothing after. max_tokens: the longest sequence.
    """

    def __init__(self, calibration=None, max_tokens=None, config=None, sinks=4, window=32, block=256,
                 reconstruction="exact", method="kvtc", settings=None):
        if method not in ("kvtc", "palu"):
            raise KVCodecError(_lib.INVALID_ARGUMENT, f"KVCodecGpuCache method {method!r} is not 'kvtc' or 'palu'")
        if max_tokens is None:
            raise KVCodecError(_lib.INVALID_ARGUMENT, "KVCodecGpuCache needs max_tokens (the longest sequence)")
        if method == "palu" and calibration is not None:
            raise KVCodecError(_lib.INVALID_ARGUMENT, "KVCodecGpuCache(method='palu') takes no kvtc calibration")
        super().__init__(method, settings=settings, calibration=calibration, config=config)
        if method == "kvtc" and self.calibration is None:
            raise KVCodecError(_lib.INVALID_ARGUMENT, "KVCodecGpuCache needs a calibration")
        self.max_tokens, self.sinks, self.window, self.block = int(max_tokens), sinks, window, block
        self.reconstruction = reconstruction

    def _make_layer(self, key_states, layer_idx, calibration_layer=None):
        if self.method == "palu":
            return PaluBlockCache(self.settings, n_kv_heads=key_states.shape[1], head_dim=key_states.shape[3],
                                  max_tokens=self.max_tokens, device=key_states.device)
        return BlockCache(self.calibration, layer_idx if calibration_layer is None else calibration_layer,
                          max_tokens=self.max_tokens, batch=key_states.shape[0], sinks=self.sinks,
                          window=self.window, block=self.block, device=key_states.device,
                          reconstruction=self.reconstruction)
