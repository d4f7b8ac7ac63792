"""`trtglm verify`: a TensorRT-LLM checkpoint, run by trtglm's runtime, against transformers.

The reference is `GlmForCausalLM` built in float32 from the HF folder (reference.py). The
checkpoint runs shard by shard in its own dtype. For every input sequence:

- teacher-forced logits over the prompt and the reference's greedy continuation:
  max |Δlogit| and top-1 agreement (share of positions whose argmax agrees);
- greedy continuations of `max_tokens` tokens from each side: the number of leading
  tokens that match. A divergence is accepted only where the reference itself scores the
  two candidates within the logit tolerance (a near tie that rounding may flip).

Tolerances (the largest |Δlogit| accepted), per precision of the checkpoint:

- float32: 1e-4 absolute. The runtime does the same float32 arithmetic in another order
  (and sums the ranks' partial results): measured differences on the tiny models are 0 at
  tp 1 and ≤ 6e-6 at tp 2–8, while a wrong weight, split or rotary detail gives 1e-2 to 10.
  Top-1 agreement must be at least 99%.
- float16 / bfloat16: K × u × sqrt(layers + 1) × max|reference logit|, with u the format's
  unit roundoff (2^-11 fp16, 2^-8 bf16) and K = 8. Every op rounds its result once, the
  errors of the layers add up roughly like a random walk, and they scale with the logits,
  hence a bound relative to the largest reference logit. Measured on the trained fixture and
  on random tiny models at tp 1–8, the worst |Δlogit| is about 1/8 of the bound unquantized
  (fixture: 0.017 of 0.12 in fp16, 0.12 of 0.96 in bf16) and at most 1/4 weight-only
  (fp16 W4A16 at tp 8: 0.032 of 0.12); a corrupt split exceeds it many times over.
  Top-1 agreement must be at least 90% (fp16) / 85% (bf16): measured ≥ 96%, and flips
  happen at near ties only.
- weight-only W8A16 / W4A16: the reference gets the same quantization (quant.py: symmetric,
  per output channel, per rank, applied to the weights as rounded to the checkpoint dtype)
  and the dtype's tolerance applies. The agreement with the *unquantized* reference is
  reported and loosely bounded (top-1 ≥ 80% int8, ≥ 50% int4; measured ≥ 96% and ≥ 68% on
  random tiny models, ≥ 89% int4 on the fixture) to catch a scale or a quantized tensor
  gone badly wrong without failing on the quantization error itself.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from trtglm.chatglm.chat import chat_ids
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.prompt_file import load_tokenizer, read_prompt_ids
from trtglm.chatglm.weights import HFWeights
from trtglm.errors import UsageError, VerificationError
from trtglm.runtime.checkpoint import CheckpointConfig, load_checkpoint
from trtglm.runtime.generate import full_logits, generate
from trtglm.runtime.model import load_model
from trtglm.runtime.quant import fake_quantize

log = logging.getLogger(__name__)

FP32_TOLERANCE = 1e-4
_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
_HALF_K = 8.0
MIN_TOP1 = {"float32": 0.99, "float16": 0.90, "bfloat16": 0.85}
MIN_TOP1_VS_UNQUANTIZED = {"W8A16": 0.80, "W4A16": 0.50}
DEFAULT_CHATS = ("你好", "hi", "What can you do?")
RANDOM_LENGTHS = (16, 40)
RANDOM_SEED = 1234

# HF weights that weight-only quantizes. Those split across ranks by rows keep their per-row
# scales; those split by columns get one scale per row per rank (its column chunk).
_QUANTIZED_BY_ROWS = ("self_attention.query_key_value.weight", "mlp.dense_h_to_4h.weight")
_QUANTIZED_BY_COLUMNS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")


@dataclass
class PromptResult:
    name: str
    tokens: int
    max_diff: float
    top1: float
    greedy_match: int
    greedy_ok: bool
    unquantized: tuple[float, float] | None = None  # (max |Δ|, top-1) vs the unquantized reference


@dataclass
class VerifyReport:
    tolerance: float
    min_top1: float
    results: list[PromptResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def top1(self) -> float:
        """Top-1 agreement over all positions of all inputs."""
        return _weighted(self.results, lambda r: r.top1)


def tolerance(cfg: CheckpointConfig, ref_scale: float) -> float:
    """Largest |Δlogit| accepted for a checkpoint of this dtype (see the module docstring)."""
    if cfg.dtype == "float32":
        return FP32_TOLERANCE
    return _HALF_K * _UNIT_ROUNDOFF[cfg.dtype] * math.sqrt(cfg.num_layers + 1) * ref_scale


def verify_checkpoint(checkpoint: str | Path, hf_model: str | Path, *, prompts: str | Path | None, max_tokens: int,
                      device: str) -> VerifyReport:
    """Compare the checkpoint with the HF model; print a table; raise VerificationError on failure."""
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {max_tokens}")
    ckpt = load_checkpoint(checkpoint)
    if ckpt.config.fp8 or ckpt.config.fp8_kv_cache:
        raise UsageError(f"{checkpoint} is an FP8 checkpoint: verify compares float and weight-only ones; compare it "
                         "with the model unquantized by `trtglm bench fp8` (docs/benchmarks.md, FP8)")
    hf_cfg = ChatGLMConfig.from_model_dir(hf_model)
    check_consistency(ckpt.config, hf_cfg)
    inputs = _inputs(Path(hf_model), prompts, ckpt.config.vocab_size)
    model = load_model(str(checkpoint), device=device, checkpoint=ckpt)
    weights = HFWeights(hf_model)
    reference = _reference(hf_cfg, weights, ckpt.config)
    unquantized = _reference(hf_cfg, weights, None) if ckpt.config.quant_algo else None

    report = _compare(model, reference, unquantized, inputs, max_tokens)
    print(format_table(report, ckpt.config))
    if not report.passed:
        raise VerificationError(f"{checkpoint} does not match {hf_model}: {report.failures[0]}")
    return report


def check_consistency(ckpt: CheckpointConfig, hf: ChatGLMConfig) -> None:
    """The checkpoint's config must describe the HF model's architecture."""
    pairs = {  # checkpoint field: (checkpoint value, HF value)
        "num_hidden_layers": (ckpt.num_layers, hf.num_layers),
        "hidden_size": (ckpt.hidden_size, hf.hidden_size),
        "num_attention_heads": (ckpt.num_heads, hf.num_heads),
        "num_key_value_heads": (ckpt.num_kv_heads, hf.num_kv_heads),
        "head_size": (ckpt.head_size, hf.head_dim),
        "intermediate_size": (ckpt.intermediate_size, hf.ffn_hidden_size),
        "vocab_size": (ckpt.vocab_size, hf.vocab_size),
        "add_qkv_bias": (ckpt.add_qkv_bias, hf.add_qkv_bias),
        "rotary_pct": (ckpt.rotary_dim, hf.rotary_dim),
        "rotary_base": (ckpt.rotary_base, hf.rotary_base),
        "rotary_scaling": (ckpt.position_scale, hf.position_scale),
        "norm_epsilon": (ckpt.norm_epsilon, hf.layernorm_epsilon),
    }
    for key, (mine, theirs) in pairs.items():
        if mine != theirs:
            raise VerificationError(f"checkpoint config {key} does not match the HF model ({mine} vs {theirs})")
    if ckpt.max_position_embeddings != hf.seq_length:
        log.warning("checkpoint max_position_embeddings %d differs from the HF seq_length %d",
                    ckpt.max_position_embeddings, hf.seq_length)


def _reference(hf_cfg: ChatGLMConfig, weights: HFWeights, ckpt: CheckpointConfig | None):
    """float32 GlmForCausalLM; with `ckpt` weight-only, its weights get the checkpoint's quantization."""
    from trtglm.chatglm.reference import load_reference

    get = weights.get
    if ckpt is not None and ckpt.quant_algo:
        def get(name: str) -> torch.Tensor:
            tensor = weights.get(name)
            if name.endswith(_QUANTIZED_BY_COLUMNS):
                return fake_quantize(tensor.to(ckpt.torch_dtype), ckpt.quant_algo, in_chunks=ckpt.tp_size)
            if name.endswith(_QUANTIZED_BY_ROWS):
                return fake_quantize(tensor.to(ckpt.torch_dtype), ckpt.quant_algo)
            return tensor
    return load_reference(hf_cfg, get, torch.float32)


# --- inputs ----------------------------------------------------------------------------------

def _inputs(hf_dir: Path, prompts: str | Path | None, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) of every sequence to compare."""
    if prompts is not None:
        return [(f"prompt {i + 1}", ids) for i, ids in enumerate(read_prompt_ids(prompts, hf_dir, "--prompts"))]
    inputs = []
    if (hf_dir / "tokenizer.model").is_file():
        tokenizer = _tokenizer(hf_dir)
        inputs += [(f"chat {text!r}", chat_ids(tokenizer, [{"role": "user", "content": text}]))
                   for text in DEFAULT_CHATS]
    generator = torch.Generator().manual_seed(RANDOM_SEED)
    inputs += [(f"random {n} ids", torch.randint(0, vocab_size, (n,), generator=generator).tolist())
               for n in RANDOM_LENGTHS]
    return inputs


def _tokenizer(hf_dir: Path):
    return load_tokenizer(hf_dir, "to encode the prompts with")


# --- comparison ------------------------------------------------------------------------------

@dataclass
class ReferenceRun:
    name: str
    prompt: list[int]
    new: list[int]  # the reference's greedy continuation
    logits: torch.Tensor  # teacher-forced over prompt + new, float32

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.new


@torch.inference_mode()
def _compare(model, reference, unquantized, inputs: list[tuple[str, list[int]]], max_tokens: int) -> VerifyReport:
    with tqdm(inputs, desc="reference", unit="input", leave=False, disable=None) as bar:
        runs = [_reference_run(reference, name, prompt, max_tokens) for name, prompt in bar]
    scale = max(float(run.logits.abs().max()) for run in runs)
    report = VerifyReport(tolerance(model.config, scale), MIN_TOP1[model.config.dtype])
    with tqdm(runs, desc="trtglm runtime", unit="input", leave=False, disable=None) as bar:
        report.results = [_compare_one(model, run, unquantized, report.tolerance) for run in bar]
    report.failures = _failures(report, model.config)
    return report


def _reference_run(reference, name: str, prompt: list[int], max_tokens: int) -> ReferenceRun:
    new = _reference_greedy(reference, prompt, max_tokens)
    return ReferenceRun(name, prompt, new, reference(torch.tensor([prompt + new])).logits[0].float())


def _compare_one(model, run: ReferenceRun, unquantized, tol: float) -> PromptResult:
    logits = full_logits(model, run.sequence).cpu()
    ours_new = generate(model, run.prompt, len(run.new))
    match = _common_prefix(ours_new, run.new)
    result = PromptResult(run.name, len(run.sequence), _max_diff(logits, run.logits), _top1(logits, run.logits),
                          match, _divergence_is_near_tie(run, ours_new, match, tol))
    if unquantized is not None:
        plain = unquantized(torch.tensor([run.sequence])).logits[0].float()
        result.unquantized = (_max_diff(logits, plain), _top1(logits, plain))
    return result


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose argmax agrees."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def _reference_greedy(reference, prompt: list[int], max_tokens: int) -> list[int]:
    out = reference(torch.tensor([prompt]), use_cache=True)
    new = []
    for step in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        new.append(token)
        if step + 1 < max_tokens:
            out = reference(torch.tensor([[token]]), use_cache=True, **_kv_cache(reference, out))
    return new


def _kv_cache(reference, out) -> dict:
    """The previous step's KV cache as this transformers' forward() takes it: `cache` (5.x, where
    `past_key_values` is deprecated), else `past_key_values`."""
    if "cache" in inspect.signature(reference.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _divergence_is_near_tie(run: ReferenceRun, ours_new: list[int], match: int, tol: float) -> bool:
    """No divergence, or the reference scores both tokens at the first divergence within 2×tol."""
    if match == len(run.new):
        return True
    row = run.logits[len(run.prompt) - 1 + match]
    return float(row[run.new[match]] - row[ours_new[match]]) <= 2 * tol


def _failures(report: VerifyReport, cfg: CheckpointConfig) -> list[str]:
    failures = []
    for r in report.results:
        if not r.max_diff <= report.tolerance:  # also catches NaN
            failures.append(f"{r.name}: max |Δlogit| {r.max_diff:.3g} > tolerance {report.tolerance:.3g}")
        if not r.greedy_ok:
            failures.append(f"{r.name}: greedy continuation diverges after {r.greedy_match} token(s) "
                            "where the reference has a clear winner")
    if report.top1 < report.min_top1:
        failures.append(f"top-1 agreement {report.top1:.1%} < {report.min_top1:.0%}")
    if cfg.quant_algo:
        plain = _weighted(report.results, lambda r: r.unquantized[1])
        bound = MIN_TOP1_VS_UNQUANTIZED[cfg.quant_algo]
        if plain < bound:
            failures.append(f"top-1 agreement with the unquantized model {plain:.1%} < {bound:.0%}")
    return failures


def _weighted(results: list[PromptResult], value) -> float:
    """Mean of `value(result)` over all positions (results weighted by their token counts)."""
    return sum(value(r) * r.tokens for r in results) / sum(r.tokens for r in results)


def format_table(report: VerifyReport, cfg: CheckpointConfig) -> str:
    quant = bool(cfg.quant_algo)
    head = f"{'input':<28} {'tokens':>6} {'max|Δlogit|':>12} {'top-1':>7} {'greedy':>7}"
    head += f" {'Δ unquant':>10} {'top-1 unq':>9}" if quant else ""
    lines = [head, "-" * len(head)]
    for r in report.results:
        line = f"{r.name[:28]:<28} {r.tokens:>6} {r.max_diff:>12.3g} {r.top1:>7.1%} {r.greedy_match:>7}"
        line += f" {r.unquantized[0]:>10.3g} {r.unquantized[1]:>9.1%}" if quant and r.unquantized else ""
        lines.append(line)
    total = sum(r.tokens for r in report.results)
    worst = max(r.max_diff for r in report.results)
    lines += ["-" * len(head),
              f"{'all':<28} {total:>6} {worst:>12.3g} {report.top1:>7.1%}",
              f"precision {cfg.dtype}{' ' + cfg.quant_algo if quant else ''}, tp {cfg.tp_size}: tolerance "
              f"max|Δlogit| <= {report.tolerance:.3g}, top-1 >= {report.min_top1:.0%} -> "
              + ("PASS" if report.passed else "FAIL")]
    return "\n".join(lines)
