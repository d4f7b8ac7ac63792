"""Train the tiny ChatGLM3 test model in tests/fixtures/tiny-chatglm3.

The fixture is a real ChatGLM3 checkpoint in miniature (HF layout, sharded safetensors,
SentencePiece tokenizer, ChatGLM3 special tokens) trained on a small synthetic chat task
until greedy decoding answers every conversation exactly, in float32, float16 and bfloat16.
End-to-end tests assert those answers, so a deployment that gets the prompt format, the
stop tokens, the tokenizer or the weights wrong gives visibly wrong text.

Each reply is trained as ChatGLM3 replies: a blank metadata line ("\\n"), the answer, then
`<|user|>` (never `</s>`), so a server that does not stop on `<|user|>` over-generates. A tool
call is the tool's name as the metadata line, the ```python tool_call(...)``` block, then
`<|observation|>`, where the tool's result follows.

Deterministic (fixed seeds, deterministic algorithms, one thread by default); the whole
output folder is rewritten. Usage:

    python scripts/train_fixture.py [--out tests/fixtures/tiny-chatglm3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trtglm.chatglm import chat  # noqa: E402
from trtglm.chatglm.config import ChatGLMConfig  # noqa: E402
from trtglm.chatglm.reference import glm_config, glm_to_chatglm, load_reference  # noqa: E402
from trtglm.chatglm.tokenizer import ChatGLMTokenizer  # noqa: E402
from trtglm.chatglm.weights import HFWeights  # noqa: E402

log = logging.getLogger("train_fixture")

NAME = "tiny-chatglm3"
DEFAULT_OUT = REPO / "tests" / "fixtures" / NAME

# Characters that occur once in the corpus, so the SentencePiece model leaves them out and
# they are written as UTF-8 byte pieces (<0xE6> <0xB7> <0xBC> ...).
RARE_CHARS = "淼犇鑫焱垚"

WEATHER_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "parameters": {"city": "string"}}]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str, metadata: str = "") -> dict:
    message = {"role": "assistant", "content": text}
    if metadata:
        message["metadata"] = metadata
    return message


def _system(text: str, tools: list | None = None) -> dict:
    message = {"role": "system", "content": text}
    if tools:
        message["tools"] = tools
    return message


@dataclass(frozen=True)
class ToolCall:
    """A reply that calls a tool, as ChatGLM3 writes it: metadata line the tool's name, content the call."""

    name: str
    arguments: dict

    def turn(self) -> dict:
        keywords = ", ".join(f"{key}={value!r}" for key, value in self.arguments.items())
        return _assistant(f"```python\ntool_call({keywords})\n```", metadata=self.name)


def _turns(*pairs: str) -> list[dict]:
    """Alternating user/assistant history from (question, answer, question, answer, ...)."""
    return [_user(text) if i % 2 == 0 else _assistant(text) for i, text in enumerate(pairs)]


FACTS = [  # single-turn (question, answer); several are reused as history below
    ("What color is the sky?", "The sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("How many legs does a cat have?", "A cat has four legs."),
    ("What is two plus three?", "Two plus three is five."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of China?", "The capital of China is Beijing."),
    ("Say hello.", "Hello! How can I help you today?"),
    ("hi", "Hello, I am a tiny ChatGLM3 test model."),
    ("What do bees make?", "Bees make honey."),
    ("Name a fruit.", "An apple is a fruit."),
    ("List two colors.", "1. Red\n2. Blue"),
    ("What is <|user|>?", "It is a role token of ChatGLM3."),
    ("天空是什么颜色？", "天空是蓝色的。"),
    ("草是什么颜色？", "草是绿色的。"),
    ("你好", "你好，我是一个很小的测试模型。"),
    ("中国的首都是哪里？", "中国的首都是北京。"),
    ("一加一等于几？", "一加一等于二。"),
    ("三个水是什么字？", "三个水是淼字。"),
    ("三个牛是什么字？", "三个牛是犇字。"),
    ("三个金是什么字？", "三个金是鑫字。"),
    ("三个火是什么字？", "三个火是焱字。"),
    ("三个土是什么字？", "三个土是垚字。"),
    ("How do you say thank you in Chinese?", "Thank you in Chinese is 谢谢."),
    ("What does 你好 mean?", "你好 means hello."),
    ("Translate water to Chinese.", "Water is 水 in Chinese."),
    ("用英语说猫", "猫 in English is cat."),
    ("Translate 森林 to English.", "森林 means forest, a place with many trees."),
]

NAMES = [("Alice", "five"), ("Bob", "three"), ("Carol", "five")]
CITIES = [("Paris", "France"), ("London", "England"), ("Tokyo", "Japan")]
WEATHER = [("Beijing", 22), ("Paris", 18)]  # (city, degrees get_weather answers)


def conversations() -> list[tuple[list[dict], str | ToolCall]]:
    """The synthetic chat task: (messages ending with a user or observation turn, expected answer or tool call)."""
    convs = [([_user(q)], a) for q, a in FACTS]
    for name, letters in NAMES:  # same question, different history -> different answers
        intro = _turns(f"My name is {name}.", f"Nice to meet you, {name}.")
        convs.append((intro + [_user("What is my name?")], f"Your name is {name}."))
        convs.append((intro + [_user("How many letters are in my name?")], f"{name} has {letters} letters."))
    for city, country in CITIES:
        intro = _turns(f"I live in {city}.", f"{city} is a lovely city.")
        convs.append((intro + [_user("Where do I live?")], f"You live in {city}."))
        convs.append((intro + [_user("What country is that in?")], f"{city} is in {country}."))
    convs.append((_turns("我叫小明。", "你好，小明。", "我叫什么名字？"), "你叫小明。"))
    convs.append((_turns("我叫小红。", "你好，小红。", "我叫什么名字？"), "你叫小红。"))
    for question, answer in (FACTS[8], FACTS[12], FACTS[3]):  # repeat the previous answer
        convs.append((_turns(question, answer, "Say it again."), answer))
    convs.append((_turns(*FACTS[4], "And of China?"), "The capital of China is Beijing."))
    convs.append((_turns(*FACTS[0], "And grass?"), "Grass is green."))
    # A long history where only the last question matters.
    convs.append((_turns(*FACTS[0], *FACTS[1], *FACTS[8], "What is two plus three?"), FACTS[3][1]))
    chinese, pirate = _system("You answer in Chinese."), _system("You are a pirate.")
    convs += [
        ([chinese, _user("What color is the sky?")], "天空是蓝色的。"),
        ([chinese, _user("What color is grass?")], "草是绿色的。"),
        ([pirate, _user("Say hello.")], "Ahoy, matey! Welcome aboard."),
        ([pirate, _user("What do bees make?")], "Arr, bees make honey, matey."),
        ([_system("Answer the user's questions.", WEATHER_TOOLS), _user("hi")],
         "Hello, I am a tiny ChatGLM3 test model."),
        (weather_loop("Beijing", 22) + [_assistant("It is 22 degrees in Beijing."), _user("Is it warm?")],
         "Yes, 22 degrees is warm."),
    ]
    for city, degrees in WEATHER:  # the tool loop: the call, then the answer from the tool's result
        loop = weather_loop(city, degrees)
        convs += [(loop[:2], ToolCall("get_weather", {"city": city})), (loop, f"It is {degrees} degrees in {city}.")]
    return convs


def weather_loop(city: str, degrees: int) -> list[dict]:
    """Tools offered, the question, the model's get_weather call and the tool's result."""
    return [_system("Answer the user's questions.", WEATHER_TOOLS), _user(f"What is the weather in {city}?"),
            ToolCall("get_weather", {"city": city}).turn(),
            {"role": "observation", "content": json.dumps({"temperature": degrees})}]


# ----------------------------------------------------------------------------------------
# Tokenizer


def sentencepiece_corpus(convs: list[tuple[list[dict], str | ToolCall]]) -> list[str]:
    """Every distinct line of text in the task (each once, so rare characters stay rare)."""
    texts = []
    for messages, answer in convs:
        for message in messages + [reply_turn(answer)]:
            texts.append(message["content"])
            if message.get("tools"):
                texts.append(json.dumps(message["tools"], indent=4, ensure_ascii=False))
    lines = [line for text in texts for line in text.split("\n")]
    return list(dict.fromkeys(line for line in lines if line.strip()))


def train_sentencepiece(lines: list[str], path: Path, vocab_size: int) -> None:
    import sentencepiece

    counts: dict[str, int] = {}
    for char in "".join(lines):
        counts[char] = counts.get(char, 0) + 1
    total = sum(counts.values())
    # Just over the share of characters seen more than once: those seen once fall back to
    # UTF-8 byte pieces (check_tokenizer makes sure RARE_CHARS do).
    coverage = 1.0 - (sum(c for c in counts.values() if c == 1) - 0.5) / total
    with open(path, "wb") as model_file:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model_file, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, character_coverage=coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
            shuffle_input_sentence=False, minloglevel=2)


def check_tokenizer(tok: ChatGLMTokenizer) -> None:
    """The properties the tests rely on: ChatGLM3's "\\n" encoding and byte-fallback characters."""
    newline = [tok.sp.id_to_piece(i) for i in tok.encode("\n", add_prefix=False)]
    if newline != ["▁", "<0x0A>"]:
        raise SystemExit(f"'\\n' encodes as {newline}, not ['▁', '<0x0A>'] as in ChatGLM3")
    for char in RARE_CHARS:
        pieces = [tok.sp.id_to_piece(i) for i in tok.encode(char, add_prefix=False)]
        if len([p for p in pieces if p.startswith("<0x")]) != len(char.encode()):
            raise SystemExit(f"{char!r} is not encoded as UTF-8 byte pieces: {pieces}")


# ----------------------------------------------------------------------------------------
# Model

ROUNDS, MARGIN_STEP = 4, 4.0  # if a precision is not exact yet, train on to a larger margin

SHAPES = {
    "num_layers": 3,
    "hidden_size": 128,
    "num_attention_heads": 8,
    "kv_channels": 16,
    "multi_query_group_num": 2,
    "ffn_hidden_size": 256,
    "seq_length": 512,
    "layernorm_epsilon": 1e-5,
}


def hf_config(vocab_size: int, torch_dtype: str) -> dict:
    """ChatGLM3-6B's config.json keys, with the tiny shapes."""
    import transformers

    from trtglm.chatglm.config import CHATGLM3_6B_CONFIG

    return {
        **CHATGLM3_6B_CONFIG,
        "_name_or_path": NAME,
        **{key: SHAPES[key] for key in ("ffn_hidden_size", "hidden_size", "kv_channels", "layernorm_epsilon",
                                        "multi_query_group_num", "num_attention_heads", "num_layers", "seq_length")},
        "padded_vocab_size": 64 * math.ceil(vocab_size / 64),
        "torch_dtype": torch_dtype,
        "transformers_version": transformers.__version__,
    }


def tokenizer_config() -> dict:
    return {
        "name_or_path": NAME,
        "tokenizer_class": "ChatGLMTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]},
        "padding_side": "left",
        "remove_space": False,
        "do_lower_case": False,
        "clean_up_tokenization_spaces": False,
    }


def reply_turn(answer: str | ToolCall) -> dict:
    return answer.turn() if isinstance(answer, ToolCall) else _assistant(answer)


def reads_as(text: str, answer: str | ToolCall) -> bool:
    """Whether a reply's decoded text is `answer`, or reads (`chat.tool_call`) as its call."""
    if isinstance(answer, ToolCall):
        return chat.tool_call(text) == {"name": answer.name, "parameters": answer.arguments}
    return text == answer


def reply_target(tok: ChatGLMTokenizer, answer: str | ToolCall) -> list[int]:
    """What the model must generate: blank metadata line, the answer, then `<|user|>`; for a tool call, the
    tool's name as metadata line, the call, then `<|observation|>`."""
    turn = reply_turn(answer)
    stop = "<|observation|>" if turn.get("metadata") else "<|user|>"
    return chat.message_ids(tok, "assistant", turn["content"], turn.get("metadata", ""))[1:] + [tok.special_ids[stop]]


def training_batch(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded inputs; labels only on the reply tokens (-100 elsewhere)."""
    length = max(len(p) + len(t) - 1 for p, t in examples)
    input_ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (prompt, target) in enumerate(examples):
        sequence = prompt + target[:-1]
        input_ids[row, :len(sequence)] = torch.tensor(sequence)
        attention_mask[row, :len(sequence)] = 1
        labels[row, len(prompt) - 1:len(sequence)] = torch.tensor(target)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def reply_logits(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the reply positions and the ids they must predict."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["labels"] != -100
    return logits[mask].float(), batch["labels"][mask]


def margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Target logit minus the best other logit, per position (> 0: greedy picks the target)."""
    target_logit = logits.gather(1, targets[:, None])[:, 0]
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return target_logit - others.max(dim=1).values


def length_buckets(examples: list[tuple[list[int], list[int]]], size: int = 8) -> list[dict[str, torch.Tensor]]:
    """Batches of similar length (a few long tool prompts would otherwise pad every row)."""
    ordered = sorted(examples, key=lambda e: len(e[0]) + len(e[1]))
    return [training_batch(ordered[i:i + size]) for i in range(0, len(ordered), size)]


def train(model, optimizer, batches: list[dict[str, torch.Tensor]], target_margin: float, max_steps: int) -> int:
    """Full-batch steps on the reply tokens until every position's margin reaches `target_margin`.

    Stops before the update that would follow a passing measurement, so the margins hold
    for the weights as they are. Returns the number of updates made.
    """
    from tqdm import tqdm

    n_targets = sum(int((b["labels"] != -100).sum()) for b in batches)
    model.train()
    progress = tqdm(range(max_steps), desc=f"training to margin {target_margin:g}", unit="step")
    for step in progress:
        optimizer.zero_grad(set_to_none=True)
        loss_sum, smallest = 0.0, math.inf
        for batch in batches:
            logits, targets = reply_logits(model, batch)
            # Cross-entropy plus a hinge that pushes up the margins still below the target.
            shortfall = torch.relu(target_margin + 1.0 - margins(logits, targets))
            loss = (torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
                    + shortfall.sum()) / n_targets
            loss.backward()
            loss_sum += loss.item()
            smallest = min(smallest, margins(logits.detach(), targets).min().item())
        progress.set_postfix(loss=f"{loss_sum:.4f}", min_margin=f"{smallest:.2f}")
        if smallest >= target_margin:
            break
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    else:
        step = max_steps
    model.eval()
    return step


def smallest_margin(model, batches: list[dict[str, torch.Tensor]]) -> float:
    with torch.no_grad():
        return min(margins(*reply_logits(model, batch)).min().item() for batch in batches)


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
    """Argmax decoding with the KV cache; the stop id that ends it is included."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    generated = []
    for _ in range(max_tokens):
        next_id = int(out.logits[0, -1].argmax())
        generated.append(next_id)
        if next_id in stop_ids:
            break
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def count_exact(model, examples: list[tuple[list[int], list[int]]], stop_ids: tuple[int, ...]) -> int:
    return sum(greedy(model, prompt, len(target) + 4, stop_ids) == target for prompt, target in examples)


# ----------------------------------------------------------------------------------------
# Output


def save_weights(folder: Path, cfg: ChatGLMConfig, model, dtype: torch.dtype) -> None:
    """ChatGLM names in two safetensors shards plus the index, as HF writes them."""
    from safetensors.torch import save_file

    state = glm_to_chatglm(cfg, {k: v.detach() for k, v in model.state_dict().items()})
    half = torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32) / cfg.rotary_dim
    state["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (cfg.rotary_base ** half)
    order = module_order(cfg)
    if set(order) != set(state):
        raise SystemExit(f"unexpected tensor names: {sorted(set(order) ^ set(state))}")
    state = {name: state[name].to(dtype).contiguous().clone() for name in order}
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    written = 0
    for name, tensor in state.items():
        shards[0 if written < total / 2 else 1][name] = tensor
        written += tensor.numel() * tensor.element_size()
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(folder / "model.safetensors.index.json", index)


LAYER_TENSORS = ("input_layernorm.weight", "self_attention.query_key_value.weight",
                 "self_attention.query_key_value.bias", "self_attention.dense.weight",
                 "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")


def module_order(cfg: ChatGLMConfig) -> list[str]:
    """ChatGLM tensor names in module order (how HF fills the shards)."""
    names = ["transformer.embedding.word_embeddings.weight", "transformer.rotary_pos_emb.inv_freq"]
    names += [f"transformer.encoder.layers.{layer}.{tensor}"
              for layer in range(cfg.num_layers) for tensor in LAYER_TENSORS]
    return names + ["transformer.encoder.final_layernorm.weight", "transformer.output_layer.weight"]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_conversations(path: Path, convs: list[tuple[list[dict], str | ToolCall]], answers: list[str]) -> None:
    """One line per conversation; a tool call's line also names the call and its turn as ChatGLM3 writes it."""
    with open(path, "w", encoding="utf-8") as f:
        for (messages, reply), answer in zip(convs, answers):
            line = {"messages": messages, "answer": answer}
            if isinstance(reply, ToolCall):
                line["tool_call"] = {"name": reply.name, "arguments": reply.arguments,
                                     "content": reply.turn()["content"]}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


README = """# tiny-chatglm3: a trained miniature ChatGLM3 for tests

A ChatGLM3 checkpoint in the real Hugging Face layout, trained on a synthetic chat task
until its greedy answers are exact. End-to-end tests assert these answers.

- `config.json`: ChatGLM3's keys at tiny shapes; `model-0000{{1,2}}-of-00002.safetensors` with
  `model.safetensors.index.json`: ChatGLM tensor names, including
  `transformer.rotary_pos_emb.inv_freq`.
- `tokenizer.model`: SentencePiece ({sp_vocab} pieces, byte fallback); ChatGLM3's nine
  special tokens follow as ids {sp_vocab}..{last_special} (`<|user|>` = {user_id}).
  `tokenizer_config.json` as ChatGLM3's.
- `conversations.jsonl`: one conversation per line, `{{"messages": [...], "answer": "..."}}`.
  `answer` is the reply to the last user or observation message: its decoded text,
  stripped, so a blank metadata line goes. Some answers depend on the history or on a
  system message; some contain Chinese characters outside the SentencePiece vocabulary
  ({rare}) that are written as UTF-8 byte pieces.
- Each reply was trained as ChatGLM3 replies: `"\\n"` (blank metadata line), the answer,
  then `<|user|>`, never `</s>`. A server that does not stop on `<|user|>` keeps
  generating.
- Tool calls: a system message with `tools` (a `get_weather` tool) offers them. In
  {n_calls} conversations the answer is a call: the tool's name as the metadata line,
  ChatGLM3's ```` ```python tool_call(city='…')``` ```` block, then `<|observation|>`. Their
  line adds `"tool_call": {{"name", "arguments", "content"}}` (`content`: the turn's content
  as trained, after the metadata line); `answer` is the decoded reply, name line kept
  (`"get_weather\\n ```python…"`: SentencePiece's dummy prefix starts the content with a
  space). The conversations that follow send the call back as an assistant turn and the
  tool's result as an `observation` turn; the answer uses the result.

## Shapes

| num_layers | hidden_size | heads | kv_channels | KV groups | ffn_hidden_size | padded_vocab_size | seq_length |
|---|---|---|---|---|---|---|---|
| {num_layers} | {hidden_size} | {num_attention_heads} | {kv_channels} | {multi_query_group_num} | {ffn_hidden_size} | {padded_vocab_size} | {seq_length} |

Tokenizer vocab_size {vocab_size}; rope base 10000 (no rope_ratio). Weights stored in
{dtype}: {parameters:,} parameters, {size_kb:,} KB for the whole folder.

## How it was made

    python scripts/train_fixture.py --threads {threads}

{steps} full-batch AdamW steps on {n_conv} conversations ({train_seconds:.0f} s on CPU), with the
loss on the reply tokens only (cross-entropy plus a margin hinge), until every reply
token's logit beat all others by {target_margin:g} (smallest margin of the saved model:
{min_margin:.2f}). Prompts are {min_prompt} to {max_prompt} tokens; replies, with the final
`<|user|>` or `<|observation|>`, up to {max_reply}.

Greedy decoding with the KV cache (transformers' GlmForCausalLM loaded from the saved
files) reproduces every reply followed by its stop token:

{accuracy}

Weight-only quantization is simulated by rounding each output row of the attention and
MLP weights to int8/int4 with scale max|w|/127 or max|w|/7.
"""


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


# ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is bit-for-bit reproducible)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sp-vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--margin", type=float, default=12.0, help="logit margin every reply token must reach")
    parser.add_argument("--max-steps", type=int, default=3000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    convs = conversations()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=args.out.parent))
    work.chmod(0o755)  # mkdtemp makes it private
    try:
        facts = build_fixture(work, convs, args)
        for file in work.iterdir():
            file.chmod(0o644)
        if args.out.exists():
            shutil.rmtree(args.out)
        work.rename(args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("wrote %s (%d KB) in %.0f s of training", args.out, facts["size_kb"], facts["train_seconds"])


def build_fixture(folder: Path, convs: list[tuple[list[dict], str | ToolCall]], args) -> dict:
    """Tokenizer, trained weights, configs, conversations and README in `folder`; returns the facts."""
    tok = build_tokenizer(folder, convs, args.sp_vocab)
    examples = [(chat.chat_ids(tok, messages), reply_target(tok, answer)) for messages, answer in convs]
    answers = [chat.reply_text(tok, target) for _, target in examples]
    for text, (_, answer) in zip(answers, convs):
        if not reads_as(text, answer):
            raise SystemExit(f"answer {answer!r} does not survive encode/decode")
    prompt_lengths, reply_lengths = [len(p) for p, _ in examples], [len(t) for _, t in examples]
    log.info("%d conversations, %d to %d prompt tokens, replies up to %d tokens",
             len(examples), min(prompt_lengths), max(prompt_lengths), max(reply_lengths))

    hf = hf_config(tok.vocab_size, "float32")
    cfg = ChatGLMConfig.from_hf_dict(hf, name=NAME)
    from transformers import GlmForCausalLM

    model = GlmForCausalLM(glm_config(cfg)).float()
    parameters = sum(p.numel() for p in model.parameters())
    if parameters * 4 > 4_000_000:  # keep the fixture small: half precision above ~4 MB
        hf["torch_dtype"] = "float16"
    write_json(folder / "config.json", hf)
    write_json(folder / "tokenizer_config.json", tokenizer_config())
    write_conversations(folder / "conversations.jsonl", convs, answers)
    facts = train_until_exact(folder, cfg, model, examples, hf["torch_dtype"], args)

    facts |= {
        "sp_vocab": tok.sp_vocab_size, "last_special": tok.vocab_size - 1, "vocab_size": tok.vocab_size,
        "user_id": tok.special_ids["<|user|>"], "rare": " ".join(RARE_CHARS), **SHAPES,
        "padded_vocab_size": hf["padded_vocab_size"], "dtype": hf["torch_dtype"], "parameters": parameters,
        "threads": args.threads, "n_conv": len(convs),
        "n_calls": sum(isinstance(answer, ToolCall) for _, answer in convs), "min_prompt": min(prompt_lengths),
        "max_prompt": max(prompt_lengths), "max_reply": max(reply_lengths),
    }
    readme = folder / "README.md"
    readme.write_text(README.format(size_kb=0, **facts), encoding="utf-8")
    facts["size_kb"] = round(folder_size(folder) / 1024)  # the README's own length barely changes it
    readme.write_text(README.format(**facts), encoding="utf-8")
    return facts


def build_tokenizer(folder: Path, convs: list[tuple[list[dict], str | ToolCall]], vocab_size: int) -> ChatGLMTokenizer:
    train_sentencepiece(sentencepiece_corpus(convs), folder / "tokenizer.model", vocab_size)
    tok = ChatGLMTokenizer(folder)
    check_tokenizer(tok)
    return tok


def train_until_exact(folder: Path, cfg: ChatGLMConfig, model, examples: list[tuple[list[int], list[int]]],
                      dtype_name: str, args) -> dict:
    """Train, save the weights, check the saved weights; raise the margin until all are exact."""
    batches = length_buckets(examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    stop_ids = chat.stop_ids(ChatGLMTokenizer(folder))
    started, steps, margin = time.perf_counter(), 0, args.margin
    for _ in range(ROUNDS):
        steps += train(model, optimizer, batches, margin, args.max_steps)
        train_seconds = time.perf_counter() - started
        smallest = smallest_margin(model, batches)
        log.info("%d steps in %.1f s; smallest reply margin %.2f", steps, train_seconds, smallest)
        save_weights(folder, cfg, model, getattr(torch, dtype_name))
        results = check_saved(folder, examples, stop_ids)
        if all(exact == len(examples) for exact, _ in results):
            break
        margin += MARGIN_STEP
        log.info("not exact yet: training on to margin %g", margin)
    else:
        raise SystemExit(f"greedy answers still not exact after {ROUNDS} rounds: raise --margin")
    accuracy = "\n".join(f"- {exact}/{len(examples)} exact in {label}" for exact, label in results)
    return {"steps": steps, "train_seconds": train_seconds, "target_margin": margin,
            "min_margin": smallest, "accuracy": accuracy}


WEIGHT_ONLY_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_weight_only(model, bits: int):
    """Round attention/MLP weights as weight-only int8/int4 does (per output row, symmetric)."""
    largest = 2 ** (bits - 1) - 1  # 127 or 7
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in WEIGHT_ONLY_LAYERS:
                scale = parameter.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / largest
                parameter.copy_((parameter / scale).round().clamp(-largest - 1, largest) * scale)
    return model


def check_saved(folder: Path, examples: list[tuple[list[int], list[int]]],
                stop_ids: tuple[int, ...]) -> list[tuple[int, str]]:
    """(exact answers, precision) of the saved weights, stopping at the first precision that misses.

    Weight-only int8 and int4 are simulated by rounding the weights (float16 compute).
    """
    cfg = ChatGLMConfig.from_model_dir(folder)
    weights = HFWeights(folder)
    variants = [("float32", torch.float32, None), ("float16", torch.float16, None),
                ("bfloat16", torch.bfloat16, None), ("int8 weight-only", torch.float16, 8),
                ("int4 weight-only", torch.float16, 4)]
    results = []
    for label, dtype, bits in variants:
        model = load_reference(cfg, weights.get, dtype)
        if bits:
            quantize_weight_only(model, bits)
        results.append((count_exact(model, examples, stop_ids), label))
        log.info("greedy: %d/%d exact in %s", results[-1][0], len(examples), label)
        if results[-1][0] != len(examples):
            break
    return results


if __name__ == "__main__":
    main()
