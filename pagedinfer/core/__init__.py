"""Bookkeeping of the paged KV cache, no tensors: the block pool and its KV-cache manager, requests
and sequences, the scheduler and its admission policy."""
