"""The KV cache: a page pool and three tiers (sink, quantized pages, recent window) per sequence."""

from kvcache.cache import KVCache
from kvcache.pool import PagePool

__all__ = ["KVCache", "PagePool"]
