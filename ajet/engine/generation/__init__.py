"""Generation: the interface the episode plane asks tokens of, and what implements it.

    interface.py            `Generator`, `GenerationRequest`, `GenerationResult`
    continuous_batching.py  the backend: transformers' continuous batching, paged KV cache
    kv_cache.py             KV cache sizing from the job and the memory available (no torch)
    recompute.py            the reference generator without a cache (bench, fallback)
    ranks.py                every rank generates: rank 0 routes episodes to the ranks
"""
