"""ChatGLM3's chat format: what a request's text becomes, where a reply ends, what its text is.

Messages. A request's text is one user message, or a chat given as JSON: `{"messages": [...]}`
or a list of message objects `{"role", "content", "metadata"?}` with roles system, user,
assistant and observation (a tool's result). A system message may carry "tools": ChatGLM3's
tool prompt is that message's content followed by the tool list as indented JSON. Other JSON
(a number, a list of numbers, an object without "messages") is text like any other. JSON is
read with `json.loads` only. An empty chat, and text that starts like a chat but does not
parse, are errors.

Prompt ids. `[gMASK] sop`, then per message `<|role|>` + encode(metadata + "\\n") +
encode(content), then `<|assistant|>` so that the model answers next.

ChatGLM2-6B, the same architecture, has no role tokens: its prompt is `[gMASK] sop` and the text
`[Round N]\n\n问：…\n\n答：…\n\n` per finished round, then `[Round N]\n\n问：…\n\n答：`
(`chatglm2_prompt`); a chat for it alternates user and assistant turns and ends with a user turn.
`PROMPT_IDS` picks the format by the checkpoint's chatglm_version.

Stop rules. A reply ends at `</s>` (end_id 2), `<|user|>` (the next turn) or `<|observation|>`
(a tool's result follows); the stop id is not part of the reply. TensorRT-LLM takes stop and
bad words as an int32 [2, n] word list per request: row 0 the ids of every word one after
another, row 1 the offset where each word ends, row 0 padded with 0 and row 1 with -1; a batch
stacks the lists padded to the widest. A word given as text is matched as generated text
spells it: a special token's name is its id, other text both SentencePiece spellings (at the
start of a line or after a space, and right after other text).

Reply text. A reply is "metadata\\ncontent": the metadata line is blank for plain text and
names the tool for a tool call. The reply's text is its decoded ids (special ids skipped)
without leading and trailing whitespace, as ChatGLM3's `process_response` strips a plain
reply: a blank metadata line goes, a tool call keeps its line. `ReplyStream` (every id in
order) and `reply_piece` (stateless: all ids so far and how many are new) give the same text
in pieces that join to exactly `reply_text`: text that more ids could still change (an
incomplete character, trailing whitespace) is held back until they come or the reply ends.

History: a conversation kept as the history API's turns is history.py's.

Tool calls. `tool_call` reads a tool-call reply's name and parameters: `NAME` then a JSON
object, or ChatGLM3's ```python tool_call(key=value, …)``` block, read as literals only.
`tools_message` is the system message that offers tools (its content, or THUDM's sentence when
there is none, then the tool list), `tool_call_content` an assistant turn's call as ChatGLM3
writes it (the ```python block; metadata: the tool's name), and `may_call_tool` tells, while a
reply streams, whether its first line is or may still become a tool's name.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from trtglm.chatglm.tokenizer import INCOMPLETE, PROMPT_PREFIX, ChatGLMTokenizer, IncrementalDetokenizer
from trtglm.chatglm.variants import DEFAULT_VERSION
from trtglm.errors import UsageError

ROLES = ("system", "user", "assistant", "observation")
STOP_TOKENS = ("<|user|>", "<|observation|>")  # besides end_id </s>
_CHAT_START = re.compile(r'\s*(\{.*"messages"|\[\s*\{)', re.S)
_ANCHOR = "\n"  # text before a word so that SentencePiece encodes it as following other text
_TOOL_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
TOOL_PROMPT = "Answer the following questions as best as you can. You have access to the following tools:"
_CODE_FENCE = re.compile(r"```(?:python)?\s*\n?(.*?)\n?\s*```", re.S)


# --- messages ---------------------------------------------------------------------------------


def chat_messages(text: str, name: str = "the prompt") -> list:
    """The messages `text` stands for: a JSON chat's, else one user message (`name` says what `text` is)."""
    if not text.strip():
        raise UsageError(f"{name} is empty")
    messages = _json_chat(text, name)
    return [{"role": "user", "content": text}] if messages is None else messages


def chat_text(messages: Sequence[dict]) -> str:
    """A chat as the JSON text that `chat_messages` reads back: `{"messages": [...]}`."""
    return json.dumps({"messages": list(messages)}, ensure_ascii=False)


def _json_chat(text: str, name: str) -> list | None:
    """The messages of a JSON chat, or None when `text` is not one."""
    if text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        data = json.loads(text)
    except RecursionError:
        raise UsageError(f"{name} nests JSON too deeply to be a chat") from None
    except json.JSONDecodeError as e:
        if _CHAT_START.match(text):
            raise UsageError(f"{name} looks like a JSON chat but is not valid JSON: {e.msg} "
                             f"(line {e.lineno}, column {e.colno})") from None
        return None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
        if not isinstance(data, list) or not data:
            raise UsageError(f'{name}: "messages" must be a non-empty list of {{"role", "content"}} objects')
        return data
    if data == []:
        raise UsageError(f"{name} is an empty chat: a chat needs at least one message")
    if isinstance(data, list) and isinstance(data[0], dict):
        return data
    return None


def checked_message(message: object, position: int) -> tuple[str, str, str]:
    """(role, content, metadata) of one chat message, a system message's tools appended to its content."""
    where = f"message {position}"
    if not isinstance(message, dict):
        raise UsageError(f"{where}: expected a dict with 'role' and 'content', not {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    metadata = "" if message.get("metadata") is None else message["metadata"]
    if role not in ROLES:
        raise UsageError(f"{where}: role must be one of {', '.join(ROLES)}, not {role!r}")
    if not isinstance(content, str):
        problem = "has no content" if content is None else f"content must be a string, not {type(content).__name__}"
        raise UsageError(f"{where}: {problem}")
    if not isinstance(metadata, str):
        raise UsageError(f"{where}: metadata must be a string, not {type(metadata).__name__}")
    if role == "system" and message.get("tools"):
        content += "\n" + json.dumps(message["tools"], indent=4, ensure_ascii=False)
    return role, content, metadata


# --- prompt ids -------------------------------------------------------------------------------


def message_ids(tokenizer: ChatGLMTokenizer, role: str, content: str, metadata: str = "") -> list[int]:
    """One turn: `<|role|>` + encode(metadata + "\\n") + encode(content)."""
    return [tokenizer.special_ids[f"<|{role}|>"]] + tokenizer.sp.encode(metadata + "\n") + tokenizer.sp.encode(content)


def chat_ids(tokenizer: ChatGLMTokenizer, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of a conversation, ending with `<|assistant|>` so that the model answers next."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise UsageError("a chat needs a non-empty list of messages")
    ids = [tokenizer.special_ids[t] for t in PROMPT_PREFIX]
    for position, message in enumerate(messages):
        ids += message_ids(tokenizer, *checked_message(message, position))
    return ids + [tokenizer.special_ids["<|assistant|>"]]


def chatglm2_prompt(messages: Sequence[dict]) -> str:
    """ChatGLM2-6B's prompt text of a conversation (see the module docstring)."""
    rounds, query = _chatglm2_rounds(messages)
    done = "".join(f"[Round {n}]\n\n问：{asked}\n\n答：{answered}\n\n"
                   for n, (asked, answered) in enumerate(rounds, 1))
    return f"{done}[Round {len(rounds) + 1}]\n\n问：{query}\n\n答："


def _chatglm2_rounds(messages: Sequence[dict]) -> tuple[list[tuple[str, str]], str]:
    """(finished rounds as (user, assistant) contents, the open round's user content)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise UsageError("a chat needs a non-empty list of messages")
    turns = [checked_message(message, position) for position, message in enumerate(messages)]
    roles = [role for role, _, _ in turns]
    if roles != ["user", "assistant"] * (len(roles) // 2) + ["user"]:
        raise UsageError("a ChatGLM2 chat alternates user and assistant turns and ends with a user turn "
                         f"(it has no system, observation or tool turns), not {', '.join(roles)}")
    contents = [content for _, content, _ in turns]
    return list(zip(contents[0:-1:2], contents[1:-1:2])), contents[-1]


def chatglm2_ids(tokenizer: ChatGLMTokenizer, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of a conversation for ChatGLM2-6B: `[gMASK] sop` and the encoded prompt text."""
    return [tokenizer.special_ids[t] for t in PROMPT_PREFIX] + tokenizer.sp.encode(chatglm2_prompt(messages))


PROMPT_IDS = {"chatglm3": chat_ids, "chatglm2": chatglm2_ids}  # variants.VERSIONS -> its prompt ids


def prompt_ids(tokenizer: ChatGLMTokenizer, text: str, name: str = "the prompt",
               version: str = DEFAULT_VERSION) -> list[int]:
    """Prompt ids of a request's text: one user message or a JSON chat (UsageError for a bad chat), in the
    prompt format of `version` (a checkpoint's chatglm_version)."""
    return PROMPT_IDS[version](tokenizer, chat_messages(text, name))


# --- stop rules and word lists ----------------------------------------------------------------


def stop_ids(tokenizer: ChatGLMTokenizer) -> tuple[int, ...]:
    """Ids that end a reply: end_id `</s>`, then `<|user|>` and `<|observation|>`."""
    return (tokenizer.eos_id, *(tokenizer.special_ids[t] for t in STOP_TOKENS))


def turn_end(tool_call: bool) -> str:
    """The stop token that ends a reply's turn: `<|observation|>` after a tool call (its result follows), else
    `<|user|>` (the next turn)."""
    next_turn, observation = STOP_TOKENS
    return observation if tool_call else next_turn


def reply_tokens(tokenizer: ChatGLMTokenizer, reply: str, tool_call: bool) -> list[str]:
    """The text of each token of a reply as ChatGLM3 writes its turn: the metadata line (a tool call's name, else
    blank), the content, then the stop token that ends the turn."""
    metadata, _, content = reply.partition("\n") if tool_call else ("", "", reply)
    # a call's text has the space that encoding its content added (SentencePiece's dummy prefix): encoding adds it again
    ids = tokenizer.sp.encode(metadata + "\n") + tokenizer.sp.encode(content.removeprefix(" "))
    return [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))] + [
        turn_end(tool_call)]


def tokenizer_facts(tokenizer: ChatGLMTokenizer | str | Path) -> dict:
    """Ids that configuration files need (pad, end, stop ids, special tokens, sizes), for a tokenizer or its path."""
    if not isinstance(tokenizer, ChatGLMTokenizer):
        tokenizer = ChatGLMTokenizer(tokenizer)
    return {
        "vocab_size": tokenizer.vocab_size,
        "sp_vocab_size": tokenizer.sp_vocab_size,
        "pad_id": tokenizer.pad_id,
        "bos_id": tokenizer.bos_id,
        "end_id": tokenizer.eos_id,
        "stop_ids": list(stop_ids(tokenizer)),
        "special_ids": dict(tokenizer.special_ids),
    }


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
    """ChatGLM3's own stop tokens besides end_id, then the id sequences of the client's stop words."""
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


def word_sequences(words: np.ndarray, name: str) -> list[list[int]]:
    """The id sequences of one [2, n] word list (`name` says which, for errors)."""
    if words.ndim != 2 or words.shape[0] != 2:
        raise UsageError(f"{name} must be [2, n] (ids over end offsets), not {list(words.shape)}")
    ids, ends = words[0].tolist(), words[1].tolist()
    sequences, start = [], 0
    for end in ends:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise UsageError(f"{name}: offset {end} does not follow {start} within {len(ids)} ids")
        sequences.append(ids[start:end])
        start = end
    return sequences


def _unique(sequences: Iterable[Sequence[int]]) -> list[list[int]]:
    seen, out = set(), []
    for ids in sequences:
        key = tuple(ids)
        if key not in seen:
            seen.add(key)
            out.append(list(ids))
    return out


# --- reply text -------------------------------------------------------------------------------


def reply_ids(tokenizer: ChatGLMTokenizer, ids: Iterable[int]) -> list[int]:
    """`ids` up to (not including) the first stop id."""
    stops = set(stop_ids(tokenizer))
    out = []
    for token in ids:
        if int(token) in stops:
            break
        out.append(int(token))
    return out


def reply_text(tokenizer: ChatGLMTokenizer, ids: Iterable[int]) -> str:
    """The reply's text from all its generated ids (see the module docstring)."""
    return tokenizer.decode(reply_ids(tokenizer, ids)).strip()


def settled_text(tokenizer: ChatGLMTokenizer, ids: Sequence[int], final: bool) -> str:
    """The reply text `ids` settle: `reply_text` when final, else without what more ids could change."""
    text = tokenizer.decode(reply_ids(tokenizer, ids))
    return text.strip() if final else text.rstrip(INCOMPLETE).strip()


def reply_piece(tokenizer: ChatGLMTokenizer, ids: Sequence[int], new: int, final: bool) -> str:
    """The text the last `new` of `ids` (all generated so far) add to the reply; `final`: no more will come."""
    before = settled_text(tokenizer, ids[:max(0, len(ids) - new)], final=False)
    return settled_text(tokenizer, ids, final)[len(before):]


class ReplyStream:
    """Pieces of one reply's text as its ids arrive; they join to `reply_text` of all the ids."""

    def __init__(self, tokenizer: ChatGLMTokenizer):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = frozenset(stop_ids(tokenizer))
        self._started = False  # some text other than whitespace was sent
        self._space = ""  # whitespace held back until text follows it
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
        """The text held back at the end of the reply (whitespace held back is dropped)."""
        if self.finished:
            return ""
        self.finished = True
        return self._visible(self._detokenizer.flush())

    def _visible(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out, self._space = self._space + body, text[len(body):]
        return out


# --- tool calls -------------------------------------------------------------------------------


def tool_call(reply: str) -> dict | None:
    """{"name", "parameters"} of a tool-call reply (see the module docstring); None for any other reply."""
    name, newline, body = reply.strip().partition("\n")
    if not newline or not _TOOL_NAME.fullmatch(name.strip()):
        return None
    fenced = _CODE_FENCE.fullmatch(body.strip())
    parameters = _call_keywords(fenced.group(1)) if fenced else _json_object(body)
    return None if parameters is None else {"name": name.strip(), "parameters": parameters}


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _call_keywords(code: str) -> dict | None:
    """The keyword arguments of `tool_call(key=literal, …)`, read without running anything."""
    try:
        call = ast.parse(code.strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"
                and not call.args and all(k.arg for k in call.keywords)):
            return None
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def tools_message(tools: Sequence[dict], content: str = "") -> dict:
    """The system message that offers `tools` (each {"name", "description", "parameters"}): `content`, or
    THUDM's tool prompt when it is empty, then the tool list (`checked_message` appends it)."""
    return {"role": "system", "content": content or TOOL_PROMPT, "tools": list(tools)}


def tool_call_content(arguments: dict) -> str:
    """An assistant turn's tool call as ChatGLM3 writes it: ```python tool_call(key=value, …)``` with the values
    as Python literals (the turn's metadata is the tool's name); a JSON object when a key is not a name."""
    if not all(isinstance(key, str) and key.isidentifier() for key in arguments):
        return json.dumps(arguments, ensure_ascii=False)
    keywords = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"```python\ntool_call({keywords})\n```"


def may_call_tool(text: str, names: Iterable[str]) -> bool:
    """Whether a reply that starts with `text` is, or may still become, a call of one of `names`: its first
    line is a tool's name, or (no line ended yet) the start of one."""
    first, newline, _ = text.partition("\n")
    first = first.strip()
    return first in names if newline else any(name.startswith(first) for name in names)
