"""TensorRT-LLM's names and defaults, which the profiles, conversion, the runtime, the backend and the benchmarks
all follow: said once here (no torch: the profiles import it)."""

DTYPES = ("float16", "bfloat16", "float32")  # a checkpoint's `dtype`, as TensorRT-LLM names them
QUANT_ALGOS = {"int8": "W8A16", "int4": "W4A16"}  # weight-only mode -> a checkpoint's `quant_algo`
MAX_NUM_TOKENS = 8192  # trtllm-build's --max_num_tokens: the tokens of one step (the 6B profiles' too)
TOKENS_PER_BLOCK = 64  # trtllm-build's --tokens_per_block: the unit of admission and prefix reuse
FREE_GPU_MEM_FRACTION = 0.9  # kv_cache_free_gpu_mem_fraction: of the GPU memory left after the weights
