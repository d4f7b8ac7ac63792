"""Answer a chat directly from a TensorRT-LLM checkpoint with trtglm's runtime (no server).

The prompt, the stop rules and the reply text are ChatGLM3's chat format (trtglm.chatglm.chat),
the same the served pipeline applies, so this is the quickest way to see what a checkpoint
answers.
"""

from __future__ import annotations

from pathlib import Path

from trtglm.chatglm import chat
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError


def answer(checkpoint: str | Path, tokenizer_dir: str | Path, prompt: str, max_new_tokens: int = 64,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           device: str = "cpu") -> str:
    """The model's reply to `prompt` (text, or a JSON chat)."""
    from trtglm.runtime.generate import generate
    from trtglm.runtime.model import load_model

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    tokenizer = ChatGLMTokenizer(tokenizer_dir)
    ids = chat.prompt_ids(tokenizer, prompt, name="--prompt")
    model = load_model(checkpoint, device=device)
    new_ids = generate(model, ids, max_new_tokens=max_new_tokens, stop_ids=chat.stop_ids(tokenizer),
                       temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return chat.reply_text(tokenizer, new_ids)
