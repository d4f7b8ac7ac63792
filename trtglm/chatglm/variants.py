"""The published ChatGLM models trtglm knows, one row each.

A variant's chatglm_version says its architecture (how rope_ratio scales positions: chatglm/config.py) and its
prompt format (chat.PROMPT_IDS); the rest of a row is what profiles, planning and older build scripts need. A new
variant is one row here, plus its prompt format in chat.PROMPT_IDS if it brings a new chatglm_version.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSIONS = ("chatglm3", "chatglm2")  # chatglm_version: architecture and prompt format
DEFAULT_VERSION = "chatglm3"  # a checkpoint or repository that does not say is ChatGLM3's


@dataclass(frozen=True)
class Variant:
    """A published ChatGLM model."""

    chatglm_version: str
    seq_length: int | None  # None: read it from the HF config
    six_b_shapes: bool  # the 6B layer/head/vocab sizes (chatglm3.md); False: HF config only
    token_limit: bool = False  # profile.LONG_CONTEXT_TOKEN_LIMIT applies
    trtllm07_name: str | None = None  # `-m` of TensorRT-LLM v0.7.1 examples/chatglm/build.py
    # FP8 in TensorRT-LLM's ChatGLM support matrix (examples/chatglm/README.md, the checkpoint-format releases)
    trtllm_fp8: bool = True
    profile: str | None = None  # its default profile, configs/<profile>.yaml


VARIANTS: dict[str, Variant] = {
    "chatglm3-6b": Variant("chatglm3", 8192, True, trtllm07_name="chatglm3_6b", profile="chatglm3-6b-bf16-tp1"),
    "chatglm3-6b-base": Variant("chatglm3", 32768, True, trtllm07_name="chatglm3_6b_base"),
    "chatglm3-6b-32k": Variant("chatglm3", 32768, True, token_limit=True, trtllm07_name="chatglm3_6b_32k",
                               profile="chatglm3-6b-32k-fp16-tp1"),
    "chatglm3-6b-128k": Variant("chatglm3", 131072, True, profile="chatglm3-6b-128k-fp16-tp1", trtllm_fp8=False),
    "chatglm2-6b": Variant("chatglm2", 32768, True, trtllm07_name="chatglm2_6b"),
    "chatglm2-6b-32k": Variant("chatglm2", 32768, True, token_limit=True, trtllm07_name="chatglm2_6b_32k"),
    # ChatGLM3 architecture at any size (the test fixture): shapes and length from its config.json
    "chatglm3-tiny": Variant("chatglm3", None, False, profile="tiny"),
}
SIX_B_SHAPE = (28, 4096)  # (layers, hidden size) of every 6B variant


def published_variant(version: str, num_layers: int, hidden_size: int, seq_length: int, rope_ratio: float) -> str:
    """The published model a checkpoint's config matches (for messages), or `<version>-custom`."""
    if (num_layers, hidden_size) != SIX_B_SHAPE:
        return f"{version}-custom"
    if version == "chatglm2":
        return "chatglm2-6b"
    if seq_length >= VARIANTS["chatglm3-6b-128k"].seq_length:
        return "chatglm3-6b-128k"
    if rope_ratio > 1:
        return "chatglm3-6b-32k"
    if seq_length >= VARIANTS["chatglm3-6b-base"].seq_length:
        return "chatglm3-6b-base"
    return "chatglm3-6b"
