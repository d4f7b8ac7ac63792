"""TensorRT-LLM's names and defaults, which the profiles, conversion, the runtime, the backend and the benchmarks
all follow, and the GPU hosts' one rule for collectives: said once here (no torch: the profiles import it)."""

DTYPES = ("float16", "bfloat16", "float32")  # a checkpoint's `dtype`, as TensorRT-LLM names them
QUANT_ALGOS = {"int8": "W8A16", "int4": "W4A16"}  # weight-only mode -> a checkpoint's `quant_algo`
MAX_NUM_TOKENS = 8192  # trtllm-build's --max_num_tokens: the tokens of one step (the 6B profiles' too)
TOKENS_PER_BLOCK = 64  # trtllm-build's --tokens_per_block: the unit of admission and prefix reuse
FREE_GPU_MEM_FRACTION = 0.9  # kv_cache_free_gpu_mem_fraction: of the GPU memory left after the weights
# NVLink multicast off, in NCCL and in PyTorch's symmetric memory (set where not set): the GPU hosts this runs on
# do not allow it, and nothing here needs it
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def keep_multicast_off(environ) -> None:
    """MULTICAST_OFF into `environ` (os.environ before NCCL or symmetric memory starts, or a child's), where unset."""
    for name, value in MULTICAST_OFF.items():
        environ.setdefault(name, value)
