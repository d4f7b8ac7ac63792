"""Answer a chat directly from a TensorRT-LLM checkpoint with trtglm's runtime (no server).

The prompt, the stop rules and the reply text are ChatGLM3's chat format (trtglm.chatglm.chat),
the same the served pipeline applies, so this is the quickest way to see what a checkpoint
answers (ChatGLM2's prompt for a ChatGLM2 checkpoint). `LocalChat` keeps the model loaded for a conversation and streams each reply in the
pieces `chat.ReplyStream` gives, which join to exactly `chat.reply_text`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from trtglm.chatglm import chat
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import ModelFileError, UsageError
from trtglm.request_config import SamplingConfig


class LocalChat:
    """A checkpoint loaded once, answering whole conversations (lists of chat messages)."""

    def __init__(self, checkpoint: str | Path, tokenizer_dir: str | Path, *, max_tokens: int, temperature: float,
                 top_k: int, top_p: float, seed: int | None, device: str):
        from trtglm.runtime.model import load_model

        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, not {max_tokens}")
        self.tokenizer = ChatGLMTokenizer(tokenizer_dir)
        self.model = load_model(checkpoint, device=device)
        version = self.model.config.chatglm_version
        if version not in chat.PROMPT_IDS:
            raise ModelFileError(f"{checkpoint}: chatglm_version {version!r} is not one of {', '.join(chat.PROMPT_IDS)}")
        self.prompt_ids = chat.PROMPT_IDS[version]  # ChatGLM3's or ChatGLM2's format
        self.options = dict(max_tokens=max_tokens, stop_ids=chat.stop_ids(self.tokenizer),
                            sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))

    def pieces(self, messages: Sequence[dict]) -> Iterator[str]:
        """The reply to `messages`, in pieces as its ids are generated."""
        from trtglm.runtime.generate import stream

        ids = self.prompt_ids(self.tokenizer, messages)
        reply = chat.ReplyStream(self.tokenizer)
        for token in stream(self.model, ids, **self.options):
            piece = reply.add([token])
            if piece:
                yield piece
        tail = reply.finish()
        if tail:
            yield tail
