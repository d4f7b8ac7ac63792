"""`trtglm synth-model`: random-weight ChatGLM3 checkpoints in the real HF layout and shapes.

The config carries every key of THUDM's published `config.json`; tensor names, order and
sharding follow the published checkpoints (`model-0000N-of-0000M.safetensors` or
`pytorch_model-0000N-of-0000M.bin` plus the index). Tensors are generated in row blocks
and streamed to disk, so a 6B checkpoint needs memory for a block, not the model (a
`.bin` shard is the exception: `torch.save` takes the whole shard). Each tensor has its
own generator seeded from (seed, name): the same seed gives the same bytes, and fewer
layers give the same first layers.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from trtglm.chatglm.config import CHATGLM3_6B_CONFIG, ChatGLMConfig
from trtglm.chatglm.variants import VARIANTS
from trtglm.convert.names import DROPPED, mapped_tensors
from trtglm.convert.safetensors_file import SafetensorsWriter, tensor_bytes
from trtglm.convert.staging import check_output, staged_output
from trtglm.convert.writer import DTYPES
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

# preset -> (overrides of CHATGLM3_6B_CONFIG, number of shards as published)
PRESETS: dict[str, tuple[dict, int]] = {
    "6b": ({}, 7),
    "6b-32k": ({"_name_or_path": "THUDM/chatglm3-6b-32k", "seq_length": VARIANTS["chatglm3-6b-32k"].seq_length,
                "rope_ratio": 50}, 7),
    "tiny": ({"_name_or_path": "trtglm/tiny-chatglm3", "num_layers": 3, "hidden_size": 128, "num_attention_heads": 8,
              "kv_channels": 16, "multi_query_group_num": 2, "ffn_hidden_size": 256, "padded_vocab_size": 512,
              "seq_length": 512}, 2),
}
FORMATS = {"safetensors": ("model", ".safetensors", "model.safetensors.index.json"),
           "bin": ("pytorch_model", ".bin", "pytorch_model.bin.index.json")}
INV_FREQ = DROPPED[0]
WEIGHT_STD = 0.02
NORM_STD = 0.05
BLOCK_ELEMENTS = 16 << 20

TensorSpec = tuple[str, tuple[int, ...]]


def synth_model(preset: str, out: str | Path, *, layers: int | None, fmt: str, dtype: str, seed: int,
                force: bool) -> Path:
    """Write a random-weight ChatGLM3 HF checkpoint for `preset` into `out`."""
    _check_options(preset, layers, fmt, dtype, seed)
    out = Path(out)
    check_output(out, force, is_hf_checkpoint, "Hugging Face checkpoint folder")
    hf_config = preset_config(preset, layers, dtype)
    cfg = ChatGLMConfig.from_hf_dict(hf_config, "chatglm3")
    specs = tensor_specs(cfg)
    shards = assign_shards(specs, DTYPES[dtype], PRESETS[preset][1])
    with staged_output(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        write_shards(tmp, specs, shards, fmt, DTYPES[dtype], seed)
    log.info("wrote %s: %s preset, %d layers, %d tensors in %d %s shard(s), %.2f GB", out, preset, cfg.num_layers,
             len(specs), max(shards.values()) + 1, fmt, total_bytes(specs, DTYPES[dtype]) / 1e9)
    return out


def _check_options(preset: str, layers: int | None, fmt: str, dtype: str, seed: int) -> None:
    if preset not in PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(PRESETS)}; not {preset!r}")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise UsageError(f"--layers must be a positive integer; not {layers!r}")
    if fmt not in FORMATS:
        raise UsageError(f"--format must be {' or '.join(FORMATS)}; not {fmt!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}; not {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"--seed must be a non-negative integer; not {seed!r}")


def preset_config(preset: str, layers: int | None = None, dtype: str = "float16") -> dict:
    """The HF config.json contents of a preset."""
    overrides, _ = PRESETS[preset]
    config = {**CHATGLM3_6B_CONFIG, **overrides, "torch_dtype": dtype}
    if layers is not None:
        config["num_layers"] = layers
    return config


def tensor_specs(cfg: ChatGLMConfig) -> list[TensorSpec]:
    """HF tensor names and shapes in the published order (embedding, rotary, layers, final norm, output)."""
    specs = [(m.hf, m.shape) for m in mapped_tensors(cfg)]
    specs.insert(1, (INV_FREQ, (cfg.rotary_dim // 2,)))
    return specs


def total_bytes(specs: list[TensorSpec], dtype: torch.dtype) -> int:
    return sum(tensor_bytes(dtype, shape) for _, shape in specs)


def assign_shards(specs: list[TensorSpec], dtype: torch.dtype, n_shards: int) -> dict[str, int]:
    """Tensor name → shard index: consecutive tensors, shards of about equal bytes, none empty."""
    total = total_bytes(specs, dtype)
    offset, raw = 0, {}
    for name, shape in specs:
        raw[name] = min(n_shards - 1, offset * n_shards // total)
        offset += tensor_bytes(dtype, shape)
    renumber = {old: new for new, old in enumerate(sorted(set(raw.values())))}
    return {name: renumber[shard] for name, shard in raw.items()}


def shard_file_names(fmt: str, n_shards: int) -> list[str]:
    stem, suffix, _ = FORMATS[fmt]
    if n_shards == 1:
        return [stem + suffix]
    return [f"{stem}-{i + 1:05d}-of-{n_shards:05d}{suffix}" for i in range(n_shards)]


def write_shards(folder: Path, specs: list[TensorSpec], shard_of: dict[str, int], fmt: str, dtype: torch.dtype,
                 seed: int) -> None:
    files = shard_file_names(fmt, max(shard_of.values()) + 1)
    with tqdm(total=total_bytes(specs, dtype), unit="B", unit_scale=True, desc="synth", disable=None) as bar:
        for index, file_name in enumerate(files):
            shard_specs = [(name, shape) for name, shape in specs if shard_of[name] == index]
            write = _write_safetensors if fmt == "safetensors" else _write_bin
            write(folder / file_name, shard_specs, dtype, seed, bar)
    if len(files) > 1:
        weight_map = {name: files[shard_of[name]] for name, _ in sorted(specs)}
        index = {"metadata": {"total_size": total_bytes(specs, dtype)}, "weight_map": weight_map}
        (folder / FORMATS[fmt][2]).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, bar: tqdm) -> None:
    with SafetensorsWriter(path, [(name, dtype, shape) for name, shape in specs], metadata={"format": "pt"}) as writer:
        for name, shape in specs:
            row = 0
            for block in random_blocks(name, shape, dtype, seed):
                bar.update(writer.write_rows(name, block, row))
                row += block.shape[0]


def _write_bin(path: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, bar: tqdm) -> None:
    shard = {name: torch.cat(list(random_blocks(name, shape, dtype, seed))) for name, shape in specs}
    torch.save(shard, path)
    bar.update(sum(t.numel() * t.element_size() for t in shard.values()))


def random_blocks(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Iterator[torch.Tensor]:
    """The tensor `name` in blocks of rows: N(0, 0.02) weights and biases, norms near 1, the real inv_freq."""
    if name == INV_FREQ:
        rotary_dim = 2 * shape[0]
        yield (1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)).to(dtype)
        return
    # torch's CPU generator keeps 32 bits of its seed: fold seed and name into 32 bits.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    is_norm = name.endswith("layernorm.weight")
    row_elements = math.prod(shape[1:])
    block = max(1, BLOCK_ELEMENTS // row_elements)
    for first in range(0, shape[0], block):
        rows = min(block, shape[0] - first)
        values = torch.randn((rows, *shape[1:]), generator=generator)
        values = values.mul_(NORM_STD).add_(1.0) if is_norm else values.mul_(WEIGHT_STD)
        yield values.to(dtype)


def is_hf_checkpoint(folder: Path) -> bool:
    """A folder holding only what `synth_model` writes (config, shards, index)."""
    names = [p.name for p in folder.iterdir()]
    allowed = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    return "config.json" in names and all(
        n in allowed or (n.startswith("model") and n.endswith(".safetensors"))
        or (n.startswith("pytorch_model") and n.endswith(".bin")) for n in names)
