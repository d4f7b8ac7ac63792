"""TensorRT-LLM's KV-cache defaults, which the profiles, the runtime, the backend and the benchmarks follow where
nothing else is said."""

TOKENS_PER_BLOCK = 64  # trtllm-build's --tokens_per_block: the unit of admission and prefix reuse
FREE_GPU_MEM_FRACTION = 0.9  # kv_cache_free_gpu_mem_fraction: of the GPU memory left after the weights
