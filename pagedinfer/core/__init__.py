"""Bookkeeping of the paged KV cache, no tensors: the block pool, requests and sequences, the scheduler."""
