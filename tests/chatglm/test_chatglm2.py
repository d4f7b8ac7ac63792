"""ChatGLM2-6B's prompt format, against literal strings of THUDM's format (its tokenizer's build_prompt, as
its README's two-round example shows), and chosen for a checkpoint converted as ChatGLM2."""

from __future__ import annotations

import pytest

from trtglm.chatglm.chat import chat_ids, chatglm2_ids, chatglm2_prompt
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

HELLO = "你好👋！我是人工智能助手 ChatGLM2-6B，很高兴见到你，欢迎问我任何问题。"


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


def test_one_round():
    assert chatglm2_prompt([{"role": "user", "content": "你好"}]) == "[Round 1]\n\n问：你好\n\n答："


def test_finished_rounds_come_before_the_open_one():
    chat = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": HELLO},
            {"role": "user", "content": "晚上睡不着应该怎么办"}]
    assert chatglm2_prompt(chat) == ("[Round 1]\n\n问：你好\n\n答：" + HELLO + "\n\n"
                                     "[Round 2]\n\n问：晚上睡不着应该怎么办\n\n答：")


def test_ids_are_gmask_sop_and_the_encoded_text(tok):
    chat = [{"role": "user", "content": "hi"}]
    assert chatglm2_ids(tok, chat) == [tok.special_ids["[gMASK]"], tok.special_ids["sop"],
                                       *tok.sp.encode("[Round 1]\n\n问：hi\n\n答：")]
    assert tok.special_ids["<|user|>"] not in chatglm2_ids(tok, chat)  # no role tokens


@pytest.mark.parametrize("roles", [["system", "user"], ["user", "user"], ["user", "assistant"], ["assistant", "user"],
                                   ["user", "observation", "user"]])
def test_other_chats_are_one_line_errors(roles):
    with pytest.raises(UsageError, match="a ChatGLM2 chat alternates user and assistant turns and ends with a user "
                                         f"turn .*not {', '.join(roles)}$"):
        chatglm2_prompt([{"role": role, "content": "x"} for role in roles])


def test_the_checkpoints_version_picks_the_format(tmp_path, fixture_dir, tok):
    from support.cli_calls import convert_checkpoint
    from trtglm.runtime.answer import LocalChat

    chat = [{"role": "user", "content": "hi"}]
    for version, expected in (("chatglm2", chatglm2_ids(tok, chat)), ("chatglm3", chat_ids(tok, chat))):
        checkpoint = convert_checkpoint(fixture_dir, tmp_path / version, chatglm_version=version)
        local = LocalChat(checkpoint, fixture_dir, max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                          device="cpu")
        assert local.prompt_ids(tok, chat) == expected
