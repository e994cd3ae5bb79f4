"""Block-table attention: the KV tensors, the function every layer calls, its per-step metadata, its backends."""
