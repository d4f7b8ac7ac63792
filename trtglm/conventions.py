"""TensorRT-LLM's names and defaults, which the profiles, conversion, the runtime, the backend and the benchmarks
all follow, and the GPU hosts' one rule for collectives: said once here (no torch: the profiles import it)."""

DTYPES = ("float16", "bfloat16", "float32")  # a checkpoint's `dtype`, as TensorRT-LLM names them
QUANT_ALGOS = {"int8": "W8A16", "int4": "W4A16"}  # weight-only mode -> a checkpoint's `quant_algo`
# FP8 (e4m3) weights and activations, one static scale per tensor: a checkpoint's `quant_algo`, and its
# `kv_cache_quant_algo` for an FP8 KV cache (TensorRT-LLM's QuantAlgo.FP8)
FP8 = "FP8"
FP8_MAX = 448.0  # the largest float8_e4m3fn: a scale maps a tensor's largest magnitude (amax) onto it
# An FP8 checkpoint's scales (float32, shape [1]): `<linear>.weights_scaling_factor` and
# `<linear>.activation_scaling_factor` beside each quantized `<linear>.weight`, and per layer
# `transformer.layers.{l}.attention.kv_cache_scaling_factor` with an FP8 KV cache (x ≈ stored value × scale)
WEIGHT_SCALE, INPUT_SCALE, KV_SCALE = "weights_scaling_factor", "activation_scaling_factor", "kv_cache_scaling_factor"
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
