"""The KV cache: a page pool and three tiers (sink, quantized pages, recent window) per sequence.

Files: cache.py (KVCache: the buffers, a step's attention and the flushes), tiers.py (the tier
rule and the sizing of a pool), pool.py (which pages are free)."""

from kvcache.cache import KVCache
from kvcache.pool import PagePool
from kvcache.tiers import CacheShape, tier_counts

__all__ = ["CacheShape", "KVCache", "PagePool", "tier_counts"]
