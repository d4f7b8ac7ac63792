"""Answer a chat directly from a TensorRT-LLM checkpoint with trtglm's runtime (no server).

The prompt gets ChatGLM3's chat template, generation stops at `</s>`, `<|user|>` or
`<|observation|>`, and the reply's metadata line is removed — the same rules the served
pipeline applies, so this is the quickest way to see what a checkpoint answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from trtglm.chatglm.tokenizer import ChatGLMTokenizer, parse_reply
from trtglm.errors import UsageError


def chat_messages(prompt: str) -> list[dict]:
    """A plain prompt is one user message; a JSON list (or {"messages": [...]}) is a conversation."""
    text = prompt.strip()
    if not text.startswith(("[", "{")):
        return [{"role": "user", "content": prompt}]
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--prompt looks like JSON but does not parse ({e.msg} at column {e.colno})") from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        raise UsageError('a JSON prompt must be a list of messages or {"messages": [...]}')
    return messages


def answer(checkpoint: str | Path, tokenizer_dir: str | Path, prompt: str, max_new_tokens: int = 64,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           device: str = "cpu") -> str:
    """The model's reply to `prompt` (text, or a JSON conversation)."""
    from trtglm.runtime.generate import generate
    from trtglm.runtime.model import load_model

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    tokenizer = ChatGLMTokenizer(tokenizer_dir)
    ids = tokenizer.build_chat_input(chat_messages(prompt))
    model = load_model(checkpoint, device=device)
    new_ids = generate(model, ids, max_new_tokens=max_new_tokens, end_id=tokenizer.eos_id,
                       stop_ids=tokenizer.stop_ids, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return parse_reply(tokenizer.decode(new_ids))
