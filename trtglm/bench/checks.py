"""`bench runtime`'s correctness checks: the fast model against `GlmForCausalLM` (same dtype and float32), each
fused kernel against its torch definition, int8/int4 matmuls against float32 products, and a trained model's logits."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from trtglm.bench.measure import DTYPES_TORCH, MODES, QUANTIZED_HF, WEIGHT_ONLY, checkpoint_tensors

log = logging.getLogger(__name__)

CHECK_SEQUENCES = 4
KERNEL_TOLERANCE = 1e-2  # relative error: bf16 rounding gives ~1e-3; a wrong kernel gives ~1


def hf_reference(cfg, hf_tensors: dict[str, torch.Tensor], device: torch.device):
    """`GlmForCausalLM` over the same tensors (no copies), rotary frequencies in float32 as HF keeps them."""
    from trtglm.chatglm.reference import load_reference

    dtype = next(iter(hf_tensors.values())).dtype
    model = load_reference(cfg, hf_tensors.__getitem__, dtype)
    model.model.rotary_emb.__init__(model.config)
    return model.to(device)


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def float32_reference_logits(cfg, hf_tensors: dict[str, torch.Tensor], device: torch.device, ids: torch.Tensor
                             ) -> torch.Tensor:
    """Logits of `GlmForCausalLM` in float32 on the same weights: how far bf16 itself lands from exact."""
    model = hf_reference(cfg, {name: t.float() for name, t in hf_tensors.items()}, device)
    logits = reference_logits(model, ids)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return logits


# --- correctness -------------------------------------------------------------------------------------------------

def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Top-1 agreement, max |Δ|, relative error; and agreement where the reference's top-2 gap exceeds max |Δ|."""
    diff = (ours - ref).abs()
    max_diff = float(diff.max())
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > max_diff
    agree = ours.argmax(-1) == ref.argmax(-1)
    return {"top1": float(agree.float().mean()), "max_abs_diff": max_diff,
            "rel_error": float((ours - ref).norm() / ref.norm()), "ref_max_abs": float(ref.abs().max()),
            "decisive_share": float(decisive.float().mean()),
            "top1_decisive": float(agree[decisive].float().mean()) if decisive.any() else None}


def check_model_logits(model, ids: torch.Tensor, references: dict[str, torch.Tensor], prompt_len: int) -> dict:
    """Prefill + CUDA-graph decode (teacher-forced), and `score`, against each reference's logits.

    Keys `{path}_vs_{reference}`: path `decode` (prefill of `prompt_len` tokens, then one decode step
    per later token) or `score` (every position of the sequence in one prefill).
    """
    slots = list(range(ids.shape[0]))
    rows = [model.prefill(slots, ids[:, :prompt_len].tolist())]
    for position in range(prompt_len, ids.shape[1] - 1):
        rows.append(model.decode(slots, ids[:, position]))
    for slot in slots:
        model.release(slot)
    decoded = torch.stack(rows, dim=1)  # logits of positions prompt_len-1 .. T-2
    scored = torch.stack([model.score(seq) for seq in ids.tolist()])
    out = {}
    for name, ref in references.items():
        out[f"decode_vs_{name}"] = compare_logits(decoded, ref[:, prompt_len - 1:-1])
        out[f"score_vs_{name}"] = compare_logits(scored, ref)
    return out


def quantized_reference_logits(cfg, hf_tensors: dict[str, torch.Tensor], algo: str, device: torch.device,
                               ids: torch.Tensor) -> torch.Tensor:
    """`GlmForCausalLM` with the weights weight-only quantization stands for (ŵ = q × scale per row, rounded
    to the dtype): what the quantized fast model should compute."""
    from trtglm.runtime.quant import fake_quantize

    tensors = {name: fake_quantize(t, algo).to(t.dtype) if name.endswith(QUANTIZED_HF) else t
               for name, t in hf_tensors.items()}
    model = hf_reference(cfg, tensors, device)
    logits = reference_logits(model, ids)
    del model, tensors
    gc.collect()
    torch.cuda.empty_cache()
    return logits


def fixture_check(fixture: Path, device: torch.device, dtype: str, prompt_len: int, new_tokens: int,
                  generator: torch.Generator) -> dict:
    """A trained tiny ChatGLM3 (`--fixture`: decisive logits, unlike random weights) run by the fast model against
    `GlmForCausalLM` in the same dtype and in float32, on random token sequences; per weight-only mode."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.weights import HFWeights
    from trtglm.runtime.fast import FastModel

    cfg, weights = ChatGLMConfig.from_model_dir(fixture), HFWeights(fixture)
    hf_tensors = {name: weights.get(name).to(device=device, dtype=DTYPES_TORCH[dtype]) for name in weights.names()
                  if not name.endswith("inv_freq")}
    ckpt_cfg, tensors = checkpoint_tensors(cfg, hf_tensors, dtype)
    length = min(prompt_len + new_tokens, cfg.seq_length)
    ids = torch.randint(0, cfg.vocab_size, (CHECK_SEQUENCES, length), device=device, generator=generator)
    references = {"hf": reference_logits(hf_reference(cfg, hf_tensors, device), ids),
                  "fp32": float32_reference_logits(cfg, hf_tensors, device, ids)}
    out = {"hf_vs_fp32": compare_logits(references["hf"], references["fp32"])}
    for mode in WEIGHT_ONLY:
        model = FastModel(ckpt_cfg, tensors, num_slots=CHECK_SEQUENCES, max_seq_len=length, weight_only=mode,
                          device=device)
        refs = references if mode == "none" else \
            {**references, "quantized": quantized_reference_logits(cfg, hf_tensors, MODES[mode], device, ids)}
        out[mode] = check_model_logits(model, ids, refs, min(prompt_len, length // 2))
    return out


def kernel_checks(cfg, device: torch.device, dtype: torch.dtype) -> dict:
    """Relative error of each Triton kernel against its torch definition, at the model's shapes."""
    from trtglm.runtime.fast.ops import TorchOps, TritonOps

    fast, ref, g = TritonOps(), TorchOps(), torch.Generator(device=device).manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device=device, generator=g) * scale).to(dtype)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    h, heads, kv, d, inner = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    out: dict[str, float] = {}
    x, delta, w = rnd(64, h), rnd(64, h), rnd(h)
    out["add_rms_norm"] = max(rel(a, b) for a, b in zip(fast.add_rms_norm(x, delta, w, 1e-5),
                                                         ref.add_rms_norm(x, delta, w, 1e-5)))
    length, slots_n, block = 1280, 9, 64
    cos, sin = _tables(cfg, length, device)
    per_slot = length // block  # each slot's blocks in a shuffled order through the paged cache (block 0: the sink)
    table = (torch.randperm(slots_n * per_slot, device=device, generator=g) + 1).view(slots_n, per_slot).int()
    caches = [rnd(1 + slots_n * per_slot, kv, block, d) for _ in range(2)]
    copies = [c.clone() for c in caches]
    qkv = rnd(64, (heads + 2 * kv) * d)
    slots = torch.randint(0, slots_n, (64,), device=device, generator=g)
    positions = torch.randperm(length, device=device, generator=g)[:64].to(torch.int32)
    q_fast = fast.rope_cache(qkv, slots, positions, cos, sin, caches[0], caches[1], table, heads)
    q_ref = ref.rope_cache(qkv, slots, positions, cos, sin, copies[0], copies[1], table, heads)
    out["rope_cache"] = max(rel(q_fast, q_ref), rel(caches[0], copies[0]), rel(caches[1], copies[1]))
    q = rnd(8, heads, d)
    slots8 = torch.randperm(slots_n, device=device, generator=g)[:8]
    positions8 = torch.randint(0, length, (8,), device=device, generator=g, dtype=torch.int32)
    out["decode_attention"] = rel(fast.decode_attention(q, caches[0], caches[1], table, slots8, positions8),
                                  ref.decode_attention(q, caches[0], caches[1], table, slots8, positions8))
    for position in (100, 1000):  # one sequence (rope_attention): one chunk of positions, and four merged
        one = slots8[:1], torch.tensor([position], dtype=torch.int32, device=device)
        attended = fast.decode_qkv_attention(qkv[:1], *one, cos, sin, caches[0], caches[1], table, heads)
        out[f"decode_qkv_attention_{position}"] = max(
            rel(attended, ref.decode_qkv_attention(qkv[:1], *one, cos, sin, copies[0], copies[1], table, heads)),
            rel(caches[0], copies[0]), rel(caches[1], copies[1]))
    y = rnd(64, 2 * inner)
    out["silu_mul"] = rel(fast.silu_mul(y), ref.silu_mul(y))
    out.update(matmul_checks(cfg, rnd, rel))
    bad = {k: v for k, v in out.items() if not v < KERNEL_TOLERANCE}
    if bad:
        log.error("kernels off their torch definitions: %s", bad)
    return out


def matmul_checks(cfg, rnd: Callable[..., torch.Tensor], rel: Callable[..., float]) -> dict[str, float]:
    """Each weight kind × kernel (one-row, tensor-core, cuBLAS) against float32 products with Ŵ."""
    from trtglm.runtime.fast import kernels
    from trtglm.runtime.fast.linear import Linear
    from trtglm.runtime.quant import fake_quantize

    h, inner, qkv_rows = cfg.hidden_size, cfg.intermediate_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size
    out = {}
    for mode, algo in (("bf16", None), ("int8", "W8A16"), ("int4", "W4A16")):
        for name, (rows, cols), bias, swiglu in (("fc", (2 * inner, h), False, False),
                                                 ("qkv", (qkv_rows, h), True, False),
                                                 ("proj_swiglu", (h, inner), False, True)):
            weight, b = rnd(rows, cols, scale=0.02), rnd(rows, scale=0.02) if bias else None
            layer = Linear.from_weight(weight, b, algo, weight.dtype, use_triton=True)
            exact = fake_quantize(weight, algo) if algo else weight.float()
            for m in (1, 16, 64, 512):
                x = rnd(m, 2 * cols if swiglu else cols)
                inputs = kernels.silu_mul(x) if swiglu else x
                expected = inputs.float() @ exact.T + (b.float() if bias else 0)
                configs = {"": kernels.CANDIDATES[1][0], "_cublas": kernels.CUBLAS} if not algo and m == 1 else \
                    {"": None, "_cublas": kernels.CUBLAS} if algo and m == 512 else {"": None}
                for suffix, config in configs.items():
                    got = kernels.matmul(x, layer.stored, layer.scale, layer.bias, layer.kind, swiglu, config)
                    out[f"{mode}_{name}_m{m}{suffix}"] = rel(got, expected)
    return out


def _tables(cfg, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from trtglm.runtime.model import rotary_tables

    cos, sin = rotary_tables(cfg, torch.arange(length, device=device)[None])
    return cos[0, 0].contiguous(), sin[0, 0].contiguous()
