"""The K/V cache's memory: the paged pool, its ABI, the block manager with its prefix cache,
the host tier, and the block events the router's index and vLLM-format subscribers follow."""
