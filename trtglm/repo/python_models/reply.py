"""Reply text from generated ids, whole or as a stream of pieces.

A ChatGLM3 reply is "metadata\\ncontent": the metadata line is blank for plain text and names
the tool for a tool call. The reply ends at the first stop id (`</s>`, `<|user|>`,
`<|observation|>`), which is not part of the text. `reply_text` returns, for plain text, the
content without the blank metadata line and without leading whitespace; a tool call keeps
its metadata line. Special ids are skipped.

`ReplyStream` gives the same text in pieces as ids arrive: it decodes incrementally (no lost
SentencePiece spaces, no split characters) and holds text back while the metadata line is
undecided, so the pieces always join to `reply_text` of all the ids. It needs to see every
id of its reply in order (the BLS model streams so).

`reply_piece` gives a piece without any state, from every id so far and how many of them
are new (what the ensemble's postprocessing receives from trtglm's runtime): the text the
ids settle now minus the text they had settled before the new ones. Settled text is the
whole decode, except that before the end a trailing incomplete character and an undecided
metadata line are held back; it only ever grows, so the pieces join to `reply_text`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from trtglm.chatglm.tokenizer import INCOMPLETE, ChatGLMTokenizer, IncrementalDetokenizer


def reply_ids(tokenizer: ChatGLMTokenizer, ids: Iterable[int]) -> list[int]:
    """`ids` up to (not including) the first stop id."""
    stops = set(tokenizer.stop_ids)
    out = []
    for token in ids:
        if int(token) in stops:
            break
        out.append(int(token))
    return out


def reply_text(tokenizer: ChatGLMTokenizer, ids: Iterable[int]) -> str:
    """The reply's text from all its generated ids (see the module docstring)."""
    return content(tokenizer.decode(reply_ids(tokenizer, ids)))


def settled_text(tokenizer: ChatGLMTokenizer, ids: Sequence[int], final: bool) -> str:
    """The reply text `ids` settle: `reply_text` when final, else without what more ids could change."""
    text = tokenizer.decode(reply_ids(tokenizer, ids))
    return content(text if final else text.rstrip(INCOMPLETE))


def reply_piece(tokenizer: ChatGLMTokenizer, ids: Sequence[int], new: int, final: bool) -> str:
    """The text the last `new` of `ids` (all generated so far) add to the reply; `final`: no more will come."""
    before = settled_text(tokenizer, ids[:max(0, len(ids) - new)], final=False)
    return settled_text(tokenizer, ids, final)[len(before):]


def content(text: str) -> str:
    """`text` without a blank metadata line and the whitespace after it; other text unchanged."""
    metadata, newline, rest = text.partition("\n")
    if metadata.strip():
        return text
    return rest.lstrip() if newline else ""


class ReplyStream:
    """Pieces of one reply's text as its ids arrive; they join to `reply_text` of all the ids."""

    def __init__(self, tokenizer: ChatGLMTokenizer):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = frozenset(tokenizer.stop_ids)
        self._head = ""  # text of an undecided metadata line
        self._state = "head"  # head -> (skip_space ->) body
        self.finished = False

    def add(self, ids: Iterable[int]) -> str:
        """Text that `ids` complete (possibly empty); a stop id finishes the reply."""
        if self.finished:
            return ""
        kept = []
        for token in ids:
            if int(token) in self._stops:
                self.finished = True
                break
            kept.append(int(token))
        text = self._detokenizer.add(kept) if kept else ""
        if self.finished:
            text += self._detokenizer.flush()
        return self._visible(text)

    def finish(self) -> str:
        """The text held back at the end of the reply."""
        if self.finished:
            return ""
        self.finished = True
        return self._visible(self._detokenizer.flush())

    def _visible(self, text: str) -> str:
        if self._state == "head":
            self._head += text
            metadata, newline, rest = self._head.partition("\n")
            if metadata.strip():
                self._state, text = "body", self._head
            elif newline:
                self._state, text = "skip_space", rest
            else:
                return ""
        if self._state == "skip_space":
            text = text.lstrip()
            if text:
                self._state = "body"
        return text
