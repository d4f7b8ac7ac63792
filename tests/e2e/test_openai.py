"""The OpenAI-compatible API of a launched server of the fixture's engine, through real clients: the openai
SDK (chat and completions, streamed and not, n > 1, stop strings, usage, log probabilities, tool calls and
their results, every kind of error), LangChain's ChatOpenAI (a tool loop too), and curl. Answers and tool calls
are the fixture's exact ones; token counts are the fixture's documented format spelled with its SentencePiece
model: the prompt `[gMASK] sop`, each turn `<|role|>` + encode(metadata + "\\n") + encode(content),
`<|assistant|>`; the reply encode("\\n") + encode(answer) + `<|user|>`, a tool call encode(name + "\\n") +
encode(the call) + `<|observation|>`."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest
from conftest import FIXTURE
from support.servers import fixture_answers, launched_server
from support.tokenizer import reply_ids, sp  # noqa: F401 (a fixture)
from trtglm.openai_api.protocol import MAX_BODY_BYTES

pytestmark = pytest.mark.slow

MODEL = "tiny"  # configs/tiny.yaml's engine name
SKY, SKY_ANSWER = "What color is the sky?", "The sky is blue."
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"city": "string"}}}
TOOL_SYSTEM = {"role": "system", "content": "Answer the user's questions."}  # the fixture's system message with tools


def conversations() -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "conversations.jsonl").read_text().splitlines()]


def conversation_ending(last: str) -> dict:
    """The fixture's conversation whose last message says `last`."""
    return next(c for c in conversations() if c["messages"][-1]["content"] == last)


def tool_loops() -> list[tuple[dict, dict]]:
    """(the conversation answered with a tool call, the one that sends its result back), per call the fixture makes."""
    calls = [c for c in conversations() if c.get("tool_call")]
    return [(call, next(c for c in conversations() if c["messages"][:2] == call["messages"]
                        and c["messages"][-1]["role"] == "observation")) for call in calls]


def observation(conversation: dict) -> str:
    return conversation["messages"][-1]["content"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from launched_server(tmp_path_factory.mktemp("openai-served"))


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.openai, api_key="none", max_retries=0, timeout=120,
                       http_client=openai.DefaultHttpxClient(trust_env=False)) as sdk:
        yield sdk


def prompt_tokens(sp, messages: list[dict]) -> int:
    count = 3  # [gMASK] sop … <|assistant|>
    for message in messages:
        tools = "\n" + json.dumps(message["tools"], indent=4, ensure_ascii=False) if message.get("tools") else ""
        count += 1 + len(sp.encode(message.get("metadata", "") + "\n")) + len(sp.encode(message["content"] + tools))
    return count


def reply_tokens(sp, answer: str) -> int:
    return len(sp.encode("\n")) + len(sp.encode(answer)) + 1  # the blank metadata line, the answer, <|user|>


def ask(client, content: str, **options):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, **options)


# --- chat ------------------------------------------------------------------------------------------


def test_models_lists_the_engine(client):
    assert [model.id for model in client.models.list()] == [MODEL]


@pytest.mark.parametrize("index", [0, 12, 18, 27, 47, 49])  # English, Chinese, 犇 (byte pieces), history, two system prompts
def test_chat_answers_are_the_fixtures_with_their_token_counts(client, sp, index):
    conversation = conversations()[index]
    answer = client.chat.completions.create(model=MODEL, messages=conversation["messages"], temperature=0)
    [choice] = answer.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == \
        ("assistant", conversation["answer"], "stop")
    assert choice.message.tool_calls is None
    expected = (prompt_tokens(sp, conversation["messages"]), reply_tokens(sp, conversation["answer"]))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == expected
    assert answer.usage.total_tokens == sum(expected) and answer.model == MODEL and answer.object == "chat.completion"


def test_streamed_chat_joins_to_the_answer_and_ends_with_usage(client, sp):
    question = "三个水是什么字？"
    chunks = list(ask(client, question, stream=True, stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    assert "".join(delta.content or "" for delta in deltas) == fixture_answers()[question]
    assert sum(1 for delta in deltas if delta.content) > 1  # streamed in pieces
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].choices == [] and all(chunk.usage is None for chunk in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (prompt_tokens(sp, [{"role": "user", "content": question}]), reply_tokens(sp, fixture_answers()[question]))
    assert len({chunk.id for chunk in chunks}) == 1


def test_n_choices_each_answer(client, sp):
    answer = ask(client, SKY, n=3)
    assert [(c.index, c.message.content) for c in answer.choices] == [(i, SKY_ANSWER) for i in range(3)]
    assert answer.usage.completion_tokens == 3 * reply_tokens(sp, SKY_ANSWER)
    chunks = list(ask(client, "Name a fruit.", n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "An apple is a fruit.", 1: "An apple is a fruit."}


def test_a_stop_string_ends_the_answer_before_it(client):
    answer = ask(client, SKY, stop=["blue", "never"])
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("The sky is ", "stop")
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, SKY, stop="blue", stream=True))
    assert streamed == "The sky is "


def test_max_tokens_ends_the_answer_by_length(client, sp):
    answer = ask(client, SKY, max_tokens=4)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    assert SKY_ANSWER.startswith(answer.choices[0].message.content)
    newer = ask(client, SKY, max_completion_tokens=4)
    assert newer.choices[0].message.content == answer.choices[0].message.content


def test_min_tokens_holds_the_end_off(client):
    """min_tokens (vLLM's extension, sent in the openai SDK's extra_body, as genai-perf sends it): the answer goes on
    past the fixture's end to exactly max_tokens tokens, and begins as the fixture's answer."""
    answer = ask(client, SKY, max_tokens=40, extra_body={"min_tokens": 40})
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (40, "length")
    assert answer.choices[0].message.content.startswith(SKY_ANSWER)
    with pytest.raises(openai.BadRequestError, match="min_tokens 41 is more than the answer may take"):
        ask(client, SKY, max_tokens=40, extra_body={"min_tokens": 41})


def test_sampling_options_are_taken(client):
    seeded = [ask(client, SKY, seed=7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5).choices[0]
              for _ in range(2)]
    assert seeded[0].message.content == seeded[1].message.content  # greedy: the penalties are far below the margin
    sampled = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SKY}],
                                             temperature=1.0, seed=3)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SKY}],
                                           temperature=1.0, seed=3)
    assert sampled.choices[0].message.content == again.choices[0].message.content  # the same seed, the same draw


def test_log_probabilities_come_per_generated_token(client, sp):
    answer = ask(client, SKY, logprobs=True, top_logprobs=0)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens == reply_tokens(sp, SKY_ANSWER)
    assert entries[-1].token == "<|user|>" and "".join(e.token for e in entries[:-1]).strip() == SKY_ANSWER
    assert all(-0.01 < entry.logprob <= 0 for entry in entries)  # the fixture's margins: greedy, near certain


# --- tools -----------------------------------------------------------------------------------------


def test_tools_a_call_and_its_result_reach_the_model_as_chatglm3_turns(client):
    """The fixture's tool conversation, sent the OpenAI way: tools, the assistant's tool_calls, a tool message."""
    conversation = conversation_ending("Is it warm?")
    messages = [TOOL_SYSTEM,
                {"role": "user", "content": "What is the weather in Beijing?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Beijing"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22}'},
                {"role": "assistant", "content": "It is 22 degrees in Beijing."},
                {"role": "user", "content": "Is it warm?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], temperature=0)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (conversation["answer"], "stop")
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == conversation["answer"]


def test_a_plain_answer_with_tools_offered_streams_as_text(client):
    conversation = next(c for c in conversations() if c["messages"][0].get("tools") and len(c["messages"]) == 2
                        and c["messages"][-1]["content"] == "hi")
    messages = [TOOL_SYSTEM, {"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == conversation["answer"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].delta.tool_calls is None for c in chunks)


@pytest.mark.parametrize("loop", tool_loops(), ids=lambda loop: loop[0]["tool_call"]["arguments"]["city"])
def test_a_tool_call_comes_as_tool_calls_and_its_result_gets_the_answer(client, sp, loop):
    """The model's call, whole: finish_reason "tool_calls", the call's name and JSON arguments, no content; the
    call sent back with the tool's result as a `tool` message gets the fixture's answer."""
    calling, answering = loop
    call = calling["tool_call"]
    system, question = calling["messages"]
    assert (system["content"], system["tools"]) == (TOOL_SYSTEM["content"], [TOOL["function"]])  # asked as trained
    messages = [TOOL_SYSTEM, question]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], temperature=0)
    [choice] = answer.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [made] = choice.message.tool_calls
    assert (made.type, made.function.name, json.loads(made.function.arguments)) == \
        ("function", call["name"], call["arguments"])
    assert made.id.startswith("call_")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == \
        (prompt_tokens(sp, calling["messages"]), len(reply_ids(sp, calling)))
    result = {"role": "tool", "tool_call_id": made.id, "content": observation(answering)}
    sent_back = choice.message.model_dump(exclude_none=True)
    final = client.chat.completions.create(model=MODEL, messages=[*messages, sent_back, result], tools=[TOOL],
                                           temperature=0)
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == (answering["answer"], "stop")
    assert final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens == prompt_tokens(sp, answering["messages"])


@pytest.mark.parametrize("loop", tool_loops(), ids=lambda loop: loop[0]["tool_call"]["arguments"]["city"])
def test_a_streamed_tool_call_comes_as_a_tool_calls_delta(client, loop):
    calling, answering = loop
    call = calling["tool_call"]
    messages = [TOOL_SYSTEM, calling["messages"][1]]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], temperature=0,
                                                 stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == ""  # the call is not sent as text
    made = [tool_call for delta in deltas for tool_call in delta.tool_calls or ()]
    assert [(m.index, m.type, m.function.name) for m in made] == [(0, "function", call["name"])]
    assert json.loads("".join(m.function.arguments for m in made)) == call["arguments"]
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "tool_calls"
    [made] = made
    function = {"name": made.function.name, "arguments": made.function.arguments}
    sent_back = {"role": "assistant", "content": None, "tool_calls": [{"id": made.id, "type": "function",
                                                                      "function": function}]}
    result = {"role": "tool", "tool_call_id": made.id, "content": observation(answering)}
    chunks = list(client.chat.completions.create(model=MODEL, messages=[*messages, sent_back, result], tools=[TOOL],
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answering["answer"]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_tool_calls_log_probabilities_spell_the_call(client, sp):
    calling, _ = tool_loops()[0]
    answer = client.chat.completions.create(model=MODEL, messages=[TOOL_SYSTEM, calling["messages"][1]],
                                            tools=[TOOL], temperature=0, logprobs=True, top_logprobs=0)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens == len(reply_ids(sp, calling))
    assert entries[-1].token == "<|observation|>" and "".join(e.token for e in entries[:-1]) == calling["answer"]
    assert all(-0.01 < entry.logprob <= 0 for entry in entries)


# --- completions -----------------------------------------------------------------------------------


def test_completions_answer_each_prompt_as_one_user_turn(client, sp):
    prompts = ["hi", "What do bees make?"]
    answer = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=40, n=2)
    answers = [fixture_answers()[p] for p in prompts]
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == \
        [(0, answers[0], "stop"), (1, answers[0], "stop"), (2, answers[1], "stop"), (3, answers[1], "stop")]
    assert answer.usage.prompt_tokens == sum(prompt_tokens(sp, [{"role": "user", "content": p}]) for p in prompts)
    assert answer.usage.completion_tokens == 2 * sum(reply_tokens(sp, a) for a in answers)


def test_streamed_completion_and_its_usage(client, sp):
    chunks = list(client.completions.create(model=MODEL, prompt="你好", temperature=0, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fixture_answers()["你好"]
    assert chunks[-1].usage.completion_tokens == reply_tokens(sp, fixture_answers()["你好"])
    short = client.completions.create(model=MODEL, prompt="你好", temperature=0)  # max_tokens 16: OpenAI's default
    assert short.usage.completion_tokens <= 16


def test_completion_log_probabilities(client, sp):
    answer = client.completions.create(model=MODEL, prompt="Say hello.", temperature=0, max_tokens=40, logprobs=0)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply_tokens(sp, fixture_answers()["Say hello."])
    assert logprobs.text_offset[0] == 0 and all(-0.01 < value <= 0 for value in logprobs.token_logprobs)


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, error, param, code", [
    ({"model": "gpt-4"}, openai.NotFoundError, "model", "model_not_found"),
    ({"max_tokens": -1}, openai.BadRequestError, "max_tokens", "invalid_value"),
    ({"temperature": 5}, openai.BadRequestError, "temperature", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, openai.BadRequestError, "messages.0.role", "invalid_value"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, openai.BadRequestError, "messages",
     "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "字" * 5000}]}, openai.BadRequestError, "messages",
     "context_length_exceeded"),
    ({"top_logprobs": 2, "logprobs": True}, openai.UnprocessableEntityError, "top_logprobs", "unsupported_value"),
    ({"response_format": {"type": "json_object"}}, openai.UnprocessableEntityError, "response_format",
     "unsupported_value"),
])
def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(client, options, error, param, code):
    request = {"model": MODEL, "messages": [{"role": "user", "content": SKY}], **options}
    with pytest.raises(error) as caught:
        client.chat.completions.create(**request)
    assert (caught.value.param, caught.value.code, caught.value.type) == (param, code, "invalid_request_error")
    assert caught.value.message and "\n" not in caught.value.message
    assert ask(client, SKY).choices[0].message.content == SKY_ANSWER


@pytest.mark.parametrize("path, body, status, code", [
    ("/chat/completions", b"{not json", 400, "invalid_json"),
    ("/chat/completions", b"[1, 2]", 400, "invalid_value"),
    ("/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "invalid_value"),
    ("/completions", json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "model_not_found"),
    ("/embeddings", b"{}", 404, "not_found"),
])
def test_raw_bad_bodies_get_the_error_shape(served, path, body, status, code):
    with httpx.Client(trust_env=False) as http:
        reply = http.post(served.openai + path, content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]


# --- limits ------------------------------------------------------------------------------------------------

LIMIT_CASES = [  # (path, body, status, param, words); each is refused before any work, then a request is exact
    ("/chat/completions", {"messages": [{"role": "user", "content": SKY}], "n": 9}, 400, "n",
     "n 9 is more than this server allows (8, its serve.max_return_sequences)"),
    ("/chat/completions", {"messages": [{"role": "user", "content": SKY}], "n": 10**6}, 400, "n",
     "is more than this server allows"),
    ("/completions", {"prompt": SKY, "n": 2, "best_of": 9}, 400, "best_of", "best_of 9 is more than this server"),
    ("/completions", {"prompt": SKY, "n": 2, "best_of": 3}, 422, "best_of", "best_of 3 above n 2 is not supported"),
    ("/completions", {"prompt": [SKY] * 4000, "n": 16}, 400, "prompt", "at most 16 items"),
    ("/chat/completions", {"messages": [{"role": "user", "content": SKY}], "stop": "x" * 2**20}, 400, "stop",
     "at most 256 characters"),
    ("/chat/completions", {"messages": [{"role": "user", "content": SKY}], "stop": "字" * 200}, 400, "stop",
     "at most 256 bytes, not 600"),
    ("/chat/completions", {"messages": [{"role": "user", "content": SKY}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop", "at most 4 items"),
]


@pytest.mark.parametrize("path, body, status, param, words", LIMIT_CASES, ids=[f"{c[0]} {c[3]} {c[2]}" for c in
                                                                                 LIMIT_CASES])
def test_requests_past_the_limits_are_refused_and_the_next_is_answered(served, client, path, body, status, param,
                                                                         words):
    with httpx.Client(trust_env=False, timeout=60) as http:
        reply = http.post(served.openai + path, json={"model": MODEL, **body})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (status, param) and words in error["message"], reply.text
    assert "\n" not in error["message"]
    assert ask(client, SKY).choices[0].message.content == SKY_ANSWER


def test_a_body_past_its_cap_is_413_before_it_is_parsed(served, client):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}]}'
    with httpx.Client(trust_env=False, timeout=60) as http:
        reply = http.post(served.openai + "/chat/completions", content=body,
                          headers={"Content-Type": "application/json"})
        streamed = http.post(served.openai + "/chat/completions", content=iter([body[:1000], body[1000:]]),
                             headers={"Content-Type": "application/json"})  # chunked: no Content-Length
    for answer in (reply, streamed):
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large", answer.text
    assert ask(client, SKY).choices[0].message.content == SKY_ANSWER


# --- other clients ---------------------------------------------------------------------------------


def test_langchain_chat_openai_invokes_and_streams(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served.openai, api_key="none", model=MODEL, temperature=0, max_retries=0,
                     http_client=httpx.Client(trust_env=False))
    assert llm.invoke("What is two plus three?").content == fixture_answers()["What is two plus three?"]
    pieces = [chunk.content for chunk in llm.stream("天空是什么颜色？")]
    assert "".join(pieces) == fixture_answers()["天空是什么颜色？"] and len([p for p in pieces if p]) > 1


def test_langchain_tool_loop_reaches_the_fixtures_answer(served):
    """bind_tools, invoke: the model calls get_weather; the Python tool runs on the call's arguments; its
    ToolMessage goes back and the model answers from it."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    results = {calling["tool_call"]["arguments"]["city"]: observation(answering) for calling, answering in tool_loops()}

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city"""
        return results[city]

    llm = ChatOpenAI(base_url=served.openai, api_key="none", model=MODEL, temperature=0, max_retries=0,
                     http_client=httpx.Client(trust_env=False)).bind_tools([TOOL])
    for calling, answering in tool_loops():
        messages = [SystemMessage(TOOL_SYSTEM["content"]), HumanMessage(calling["messages"][1]["content"])]
        asked = llm.invoke(messages)
        assert [(c["name"], c["args"]) for c in asked.tool_calls] == \
            [(calling["tool_call"]["name"], calling["tool_call"]["arguments"])]
        messages += [asked, get_weather.invoke(asked.tool_calls[0])]
        assert messages[-1].content == observation(answering)
        answered = llm.invoke(messages)
        assert (answered.content, answered.tool_calls) == (answering["answer"], [])


def test_curl_asks_for_a_chat_completion(served):
    body = json.dumps({"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "What do bees make?"}]})
    done = subprocess.run(["curl", "-s", "--noproxy", "*", f"{served.openai}/chat/completions",
                           "-H", "Content-Type: application/json", "-d", body],
                          capture_output=True, text=True, timeout=60)
    answer = json.loads(done.stdout)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Bees make honey."}
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]


class WatchedCalls:
    """Wraps the API's gRPC client: each stream it opens, whether it was cancelled and the status it ended with."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def stream_infer(self, requests):
        responses = self.client.stream_infer(requests)
        self.calls.append(responses)
        return responses

    async def codes(self) -> list[str]:
        return [str(await responses._grpc_call.code()) for responses in self.calls]


@pytest.mark.parametrize("abandoned", [False, True], ids=["complete", "abandoned"])
def test_a_complete_replys_stream_ends_uncancelled_and_an_abandoned_one_is_cancelled(served, abandoned):
    """The API's own gRPC streams to Triton: one whose request is complete is read to Triton's end of it (status
    OK; a cancellation meeting a request's last response can abort Triton 2.51, docs/troubleshooting.md), and one
    whose reader stops early is cancelled (status CANCELLED)."""
    import asyncio

    from trtglm.openai_api.served import client_model
    from trtglm.openai_api.triton import Ask, Triton
    from trtglm.request_config import OutputConfig, SamplingConfig

    async def ask() -> tuple[str, list[str]]:
        triton = Triton(served.grpc, client_model(served.repo))
        watched = WatchedCalls(triton.client)
        triton._client = watched
        ask = Ask([{"role": "user", "content": SKY}], 64, SamplingConfig(), OutputConfig(), (), stream=True)
        pieces, text = triton.pieces(ask), ""
        async for piece in pieces:
            text += piece.text
            if abandoned:
                break
        await pieces.aclose()
        return text, await watched.codes()

    text, codes = asyncio.run(ask())
    if abandoned:
        assert SKY_ANSWER.startswith(text) and text != SKY_ANSWER and codes == ["StatusCode.CANCELLED"]
    else:
        assert (text, codes) == (SKY_ANSWER, ["StatusCode.OK"])


FAN_OUT = {"prompts": [f"{i} + 1" for i in range(16)], "n": 8, "tokens": 128}  # 16 × 8 = 128 sequences, 8 slots


def api_waiting(served) -> float:
    """The API's sequences waiting for a place, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(served.openai.removesuffix("/v1") + "/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith('trtglm_openai_sequences{state="waiting"}'))


def test_a_request_of_many_sequences_is_queued_while_a_small_one_beside_it_is_answered(served, client):
    """16 prompts × n 8 (the most the API takes) on an engine of 8 slots: served whole, its sequences admitted as
    places free, while a small request sent after it is answered before it; another large one meanwhile is
    refused whole (429, Retry-After), and the waiting line shows on the API's /metrics. Streamed, the same large
    request starts with 200 and every choice ends by its length (none fails for capacity)."""
    import concurrent.futures
    import time

    def big(stream: bool = False, tokens: int = FAN_OUT["tokens"]):
        body = {"model": MODEL, "prompt": FAN_OUT["prompts"], "n": FAN_OUT["n"], "max_tokens": tokens,
                "extra_body": {"min_tokens": tokens}}
        if not stream:
            return client.completions.create(**body).choices
        return [c for chunk in client.completions.create(**body, stream=True) for c in chunk.choices
                if c.finish_reason]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(big)
        deadline = time.monotonic() + 60
        while (waiting := api_waiting(served)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting > 0  # the large request is in line
        with pytest.raises(openai.RateLimitError) as refused:
            big()
        assert refused.value.response.headers["retry-after"] == "1"
        started = time.monotonic()
        small = client.chat.completions.create(model=MODEL, temperature=0, messages=[{"role": "user", "content": SKY}])
        small_s = time.monotonic() - started
        assert small.choices[0].message.content == SKY_ANSWER
        assert not whole.done(), "the small request waited for the large one"
        assert len(whole.result(timeout=600)) == 128 and {c.finish_reason for c in whole.result()} == {"length"}
    assert small_s < 30, small_s
    streamed = big(stream=True, tokens=16)
    assert len(streamed) == 128 and {c.finish_reason for c in streamed} == {"length"}
