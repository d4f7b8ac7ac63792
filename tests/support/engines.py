"""The fixture's torch engine built as `trtglm build-engine` builds it (configs/tiny.yaml), its chat prompts and
what the unsplit model answers them."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURE, REPO
from support.cli_calls import build_engine

from trtglm.chatglm.chat import chat_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.runtime.generate import generate
from trtglm.runtime.model import load_model

PROFILE = REPO / "configs" / "tiny.yaml"
MAX_NEW = 40  # new tokens per prompt where the rank and engine-process tests compare against the unsplit model


def build_tiny_engine(out: Path, tp: int = 1, **overrides) -> Path:
    """The fixture's torch engine (configs/tiny.yaml) at tensor-parallel size `tp`."""
    return build_engine(PROFILE, model_dir=FIXTURE, output_dir=out,
                        overrides={"convert.tp_size": tp, **overrides})


def chat_prompts(every: int) -> list[list[int]]:
    """Prompt ids of every `every`-th fixture conversation."""
    tok = ChatGLMTokenizer(FIXTURE)
    conversations = [json.loads(line) for line in (FIXTURE / "conversations.jsonl").read_text().splitlines()]
    return [chat_ids(tok, c["messages"]) for c in conversations[::every]]


def unsplit_answers(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    """generate() on a checkpoint, each prompt alone, with the stop token appended as the runtime returns it."""
    model = load_model(checkpoint)
    out = []
    for prompt in prompts:
        tokens = generate(model, prompt, MAX_NEW, end_id=2, stop_ids=[518, 520])
        out.append(tokens + [518] if len(tokens) < MAX_NEW else tokens)
    return out
