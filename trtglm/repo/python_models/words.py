"""Stop words, bad words and embedding bias in the layout TensorRT-LLM takes.

A word list of one request is an int32 array of shape [2, n]: row 0 holds the ids of every
word one after another, row 1 the offset at which each word ends; row 0 is padded with 0 and
row 1 with -1. A batch stacks the requests' lists, padded to the widest.

A word given as text is matched as generated text spells it: the name of a ChatGLM3 special
token ("<|user|>", "</s>") is that token's id, and other text becomes two id sequences, the
one SentencePiece gives at the start of a line or after a space ("▁word") and the one it
gives right after other text. Stop words always include `<|user|>` and `<|observation|>`
(ChatGLM3's turn ends besides `</s>`, which is the end id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from trtglm.chatglm.tokenizer import STOP_TOKENS, ChatGLMTokenizer
from trtglm.errors import UsageError

_ANCHOR = "\n"  # text before a word so that SentencePiece encodes it as following other text


def word_ids(tokenizer: ChatGLMTokenizer, word: str) -> list[list[int]]:
    """The id sequences that spell `word` in generated text (see the module docstring)."""
    if word in tokenizer.special_ids or word == "</s>":
        return [[tokenizer.token_id(word)]]
    variants = [tokenizer.sp.encode(word)]
    anchor = tokenizer.sp.encode(_ANCHOR)
    anchored = tokenizer.sp.encode(_ANCHOR + word)
    if anchored[:len(anchor)] == anchor:
        variants.append(anchored[len(anchor):])
    return _unique(v for v in variants if v)


def stop_sequences(tokenizer: ChatGLMTokenizer, words: Iterable[str]) -> list[list[int]]:
    """ChatGLM3's own stop tokens, then the id sequences of the client's stop words."""
    own = [[tokenizer.special_ids[name]] for name in STOP_TOKENS]
    return _unique([*own, *(ids for word in words for ids in word_ids(tokenizer, word))])


def bad_sequences(tokenizer: ChatGLMTokenizer, words: Iterable[str]) -> list[list[int]]:
    return _unique(ids for word in words for ids in word_ids(tokenizer, word))


def word_list(sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """[2, n] int32: concatenated ids over their end offsets (an empty list is [[0], [-1]])."""
    flat = [token for ids in sequences for token in ids]
    ends = np.cumsum([len(ids) for ids in sequences], dtype=np.int64)
    out = np.zeros((2, max(1, len(flat))), dtype=np.int32)
    out[1] = -1
    out[0, :len(flat)] = flat
    out[1, :len(ends)] = ends
    return out


def stack_word_lists(lists: Sequence[np.ndarray]) -> np.ndarray:
    """[batch, 2, widest] from per-request [2, n] lists (ids padded with 0, offsets with -1)."""
    width = max(item.shape[1] for item in lists)
    out = np.zeros((len(lists), 2, width), dtype=np.int32)
    out[:, 1] = -1
    for row, item in enumerate(lists):
        out[row, :, :item.shape[1]] = item
    return out


def embedding_bias(tokenizer: ChatGLMTokenizer, words: Sequence[str], weights: Sequence[float],
                   vocab_size: int) -> np.ndarray:
    """[vocab_size] float32 adding each word's weight to the logits of its ids ([0] when no words)."""
    if len(words) != len(weights):
        raise UsageError(f"embedding_bias_words has {len(words)} entries but embedding_bias_weights has "
                         f"{len(weights)}")
    if not words:
        return np.zeros(0, dtype=np.float32)
    bias = np.zeros(vocab_size, dtype=np.float32)
    for word, weight in zip(words, weights, strict=True):
        ids = sorted({token for seq in word_ids(tokenizer, word) for token in seq})
        bias[ids] += np.float32(weight)
    return bias


def _unique(sequences: Iterable[Sequence[int]]) -> list[list[int]]:
    seen, out = set(), []
    for ids in sequences:
        key = tuple(ids)
        if key not in seen:
            seen.add(key)
            out.append(list(ids))
    return out
