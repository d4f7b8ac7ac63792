"""Fixtures the runtime's parity tests share: the fixture converted to one float32 shard, transformers'
GlmForCausalLM with the same weights (the reference), and four of the fixture's chat prompts; and the
reference's greedy reply with its logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from support.cli_calls import convert_checkpoint
from trtglm.chatglm.chat import chat_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.runtime.model import load_model


FLOAT32_UNIT = 2.0 ** -24  # float32's unit roundoff


def reordered_float32_atol(config, reference: torch.Tensor, headroom: float = 4.0) -> float:
    """How far float32 logits may move when the same computation adds up in another order (a prompt prefilled in
    chunks, other rows in the batch, another CPU's vector width): each addition rounds by up to one unit roundoff
    of its result, and the errors add up like a random walk over the additions a logit passes through, about
    num_layers × (hidden + ffn) of them, scaled by the logits' magnitude; `headroom` for the walk's spread."""
    additions = config.num_layers * (config.hidden_size + config.intermediate_size)
    return headroom * FLOAT32_UNIT * math.sqrt(additions) * float(reference.abs().max())


@pytest.fixture(scope="module")
def tp1_model(tmp_path_factory, fixture_dir):
    return load_model(convert_checkpoint(fixture_dir, tmp_path_factory.mktemp("ckpt") / "tp1", dtype="float32"))


@pytest.fixture(scope="module")
def glm_reference(fixture_dir):
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.reference import load_reference
    from trtglm.chatglm.weights import HFWeights

    return load_reference(ChatGLMConfig.from_model_dir(fixture_dir), HFWeights(fixture_dir).get, torch.float32)


@pytest.fixture(scope="module")
def four_prompts(fixture_dir) -> list[list[int]]:
    """Four of the fixture's chat prompts: the model's replies end with <|user|> in some beams, not in others."""
    tok = ChatGLMTokenizer(fixture_dir)
    lines = (fixture_dir / "conversations.jsonl").read_text().splitlines()
    return [chat_ids(tok, json.loads(line)["messages"]) for line in lines][::7][:4]


def greedy_with_logits(reference, prompt: list[int], limit: int, end_id: int, stops: tuple[int, ...] = (),
                       choosable: int | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' greedy reply to `prompt`, as TensorRT-LLM returns it (up to `end_id`, not returned, or a stop
    token, returned, or `limit` ids; ids chosen among the first `choosable`, the tokenizer's), with its float32
    logits: every prompt position's `[prompt, vocab]` and each returned id's step's `[ids, vocab]`."""
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(limit):
            row = reference(torch.tensor([list(prompt) + ids])).logits[0, -1]
            token = int(row[:choosable].argmax())
            if token == end_id:
                break
            ids.append(token)
            if token in stops:
                break
        logits = reference(torch.tensor([list(prompt) + ids])).logits[0].float().numpy()
    return ids, logits[:len(prompt)], logits[len(prompt) - 1:len(prompt) - 1 + len(ids)]
