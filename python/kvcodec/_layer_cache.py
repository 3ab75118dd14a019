"""What kvcodec's layer caches answer alike, in one place.

StatsAttributes: each field of a cache's stats() as a read-only attribute
(kvcodec.Cache, kvcodec.PaluBlockCache). HeldLayerCache: the layer
protocol of the caches that keep their history as torch tensors on the
input's device (kvcodec.BlockCache, kvcodec.PaluBlockCache), given their
append(), fetch() and offset.
"""


class StatsAttributes:
    compressed_key_bytes = property(lambda self: self.stats()["compressed_key_bytes"])
    compressed_value_bytes = property(lambda self: self.stats()["compressed_value_bytes"])
    fp16_key_bytes = property(lambda self: self.stats()["fp16_key_bytes"])
    fp16_value_bytes = property(lambda self: self.stats()["fp16_value_bytes"])
    resident_bytes = property(lambda self: self.stats()["resident_bytes"])  # memory held
    compression_ratio = property(lambda self: self.stats()["compression_ratio"])


class HeldLayerCache:
    def update_and_fetch(self, keys, values):
        """append() then the whole history (fetch())."""
        self.append(keys, values)
        return self.fetch()

    def size(self):
        return self.offset

    def is_trimmable(self):
        return True
