"""The ChatGLM3 tokenizer, without `trust_remote_code`.

ChatGLM3 uses a SentencePiece model (`tokenizer.model`) and appends nine special tokens
after its vocabulary. A plain encoding starts with `[gMASK] sop` (the chat format built on
it is chat.py's). Special-token text typed by a user is ordinary text: only ids given as
special tokens are special.

Decoding works on runs of ordinary ids separated by special ids, each run decoded by
SentencePiece as a whole (as ChatGLM3 does), so spaces and multi-byte characters survive.
`IncrementalDetokenizer` produces the same text piece by piece for streaming.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path

from trtglm.errors import ModelFileError, UsageError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
SPECIAL_TOKENS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop",
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
PROMPT_PREFIX = ("[gMASK]", "sop")
INCOMPLETE = "\ufffd"  # what SentencePiece decodes a partial UTF-8 sequence to


class ChatGLMTokenizer:
    """SentencePiece pieces (ids 0..n-1) followed by ChatGLM3's nine special tokens (n..n+8).

    `path` is a folder holding `tokenizer.model` or the file itself; `sp` is the loaded
    `sentencepiece.SentencePieceProcessor` for callers that need raw pieces.
    """

    def __init__(self, path: str | Path):
        self.path = _model_file(Path(path))
        self.sp = _load_sentencepiece(self.path)
        n = self.sp.vocab_size()
        self.sp_vocab_size = n
        self.special_ids: dict[str, int] = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self._special_names = {i: name for name, i in self.special_ids.items()}

    # --- ids -------------------------------------------------------------------------------

    @functools.cached_property
    def longest_piece_bytes(self) -> int:
        """The most bytes of (normalized) text one token can stand for."""
        pieces = (self.sp.id_to_piece(i) for i in range(self.sp_vocab_size))
        return max(len(piece.replace("\u2581", " ").encode("utf-8")) for piece in pieces)

    @property
    def vocab_size(self) -> int:
        return self.sp_vocab_size + len(SPECIAL_TOKENS)

    @property
    def pad_id(self) -> int:
        return self.sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def token_id(self, name: str) -> int:
        """Id of a special token (`"<|user|>"`) or of a SentencePiece piece (`"</s>"`, `"▁"`)."""
        if name in self.special_ids:
            return self.special_ids[name]
        piece_id = self.sp.piece_to_id(name)
        if piece_id == self.sp.unk_id() and name != self.sp.id_to_piece(piece_id):
            raise UsageError(f"unknown token {name!r}: neither a ChatGLM3 special token nor a piece of {self.path}")
        return piece_id

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_names

    # --- encoding --------------------------------------------------------------------------

    def encode(self, text: str, add_prefix: bool = True) -> list[int]:
        """`[gMASK] sop` + SentencePiece ids of `text` (special-token text stays plain text)."""
        if not isinstance(text, str):
            raise UsageError(f"text to encode must be a string, not {type(text).__name__}")
        prefix = [self.special_ids[t] for t in PROMPT_PREFIX] if add_prefix else []
        return prefix + self.sp.encode(text)

    # --- decoding --------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`: each run of ordinary ids decoded whole; special ids as text or skipped."""
        text, run = [], []
        for token_id in self.checked_ids(ids):
            if token_id in self._special_names:
                text.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    text.append(self._special_names[token_id])
            else:
                run.append(token_id)
        text.append(self.sp.decode(run))
        return "".join(text)

    def checked_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of ints; UsageError for one outside the vocabulary."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the tokenizer's vocabulary (0..{self.vocab_size - 1})")
        return ids

    def incremental(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces whose concatenation is `decode(all ids)`.

    Each step decodes a window that starts at the last emitted boundary and emits what the
    window adds beyond the text already emitted from it. This keeps SentencePiece's leading
    spaces (a piece decoded alone loses its "▁") and holds back text ending in a partial
    UTF-8 character until the character is complete. Special ids are skipped and end a run,
    as in `ChatGLMTokenizer.decode`.
    """

    def __init__(self, tokenizer: ChatGLMTokenizer):
        self.tokenizer = tokenizer
        self._run: list[int] = []  # ordinary ids since the last special id
        self._prefix_offset = 0  # window start within the run
        self._read_offset = 0  # ids before this have been emitted

    def add(self, ids: int | Iterable[int]) -> str:
        """Feed one or more token ids; returns the new text (possibly empty)."""
        ids = ids if isinstance(ids, Iterable) else [ids]
        pieces = []
        for token_id in self.tokenizer.checked_ids(ids):
            if self.tokenizer.is_special(token_id):
                pieces.append(self.flush())
            else:
                self._run.append(token_id)
                pieces.append(self._step(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Emit any held-back text (even an incomplete character) and start a new run."""
        text = self._step(final=True)
        self._run, self._prefix_offset, self._read_offset = [], 0, 0
        return text

    def _step(self, final: bool) -> str:
        decode = self.tokenizer.sp.decode
        emitted = decode(self._run[self._prefix_offset:self._read_offset])
        window = decode(self._run[self._prefix_offset:])
        if len(window) <= len(emitted) or (window.endswith(INCOMPLETE) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._run)
        return window[len(emitted):]


def _model_file(path: Path) -> Path:
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ModelFileError(f"{file}: tokenizer model not found")
    return file


def _load_sentencepiece(file: Path):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.load(str(file))
    except (OSError, RuntimeError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFileError(f"{file}: not a SentencePiece model ({first_line})") from None
    log.debug("loaded %s: %d pieces", file, processor.vocab_size())
    return processor
