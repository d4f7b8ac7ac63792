"""The OpenAI API's requests as ChatGLM3 chats (written out as ChatGLM3's turns), the refusals, and one choice's
text as pieces arrive: stop strings, held-back text, tool calls. Served answers: tests/e2e/test_openai.py."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from support.cli_calls import patch_repo
from support.repos import make_engine

from trtglm.chatglm.chat import chat_ids, chatglm2_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.openai_api.answers import Api
from trtglm.openai_api.errors import ApiError, validation_error
from trtglm.openai_api.prompts import chatglm_messages
from trtglm.openai_api.protocol import MAX_PROMPTS, MAX_STOP_BYTES, ChatRequest, CompletionRequest, refuse_unsupported
from trtglm.openai_api.replies import ChoiceText
from trtglm.openai_api.served import client_model, served_model
from trtglm.openai_api.triton import Ask, Piece, api_error_of, triton_inputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"city": "string"}}}
THUDM_PROMPT = "Answer the following questions as best as you can. You have access to the following tools:"


def chat(**fields) -> ChatRequest:
    return ChatRequest(model="tiny", **{"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tools_and_a_call_loop_become_chatglm3_turns():
    request = chat(tools=[WEATHER], messages=[
        {"role": "system", "content": "Answer the user's questions."},
        {"role": "user", "content": "What is the weather in Beijing?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 22 degrees in Beijing."}]},
        {"role": "user", "content": "Is it warm?"}])
    assert chatglm_messages(request) == [
        {"role": "system", "content": "Answer the user's questions.",
         "tools": [{"name": "get_weather", "description": "Weather of a city", "parameters": {"city": "string"}}]},
        {"role": "user", "content": "What is the weather in Beijing?"},
        {"role": "assistant", "metadata": "get_weather", "content": "```python\ntool_call(city='Beijing')\n```"},
        {"role": "observation", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "It is 22 degrees in Beijing."},
        {"role": "user", "content": "Is it warm?"}]


def test_tools_without_a_system_message_get_thudms_prompt_and_tool_choice_none_offers_none():
    offered = chatglm_messages(chat(tools=[WEATHER], messages=[{"role": "developer", "content": "Be brief."},
                                                                {"role": "user", "content": "hi"}]))
    assert offered[0]["content"] == "Be brief." and len(offered) == 2
    default = chatglm_messages(chat(tools=[WEATHER]))
    assert default[0] == {"role": "system", "content": THUDM_PROMPT, "tools": [
        {"name": "get_weather", "description": "Weather of a city", "parameters": {"city": "string"}}]}
    assert chatglm_messages(chat(tools=[WEATHER], tool_choice="none")) == [{"role": "user", "content": "hi"}]
    assert chatglm_messages(chat(messages=[{"role": "developer", "content": "Be brief."}])) == [
        {"role": "system", "content": "Be brief."}]


def test_a_tool_call_whose_arguments_are_not_an_object_is_a_400():
    request = chat(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}])
    with pytest.raises(ApiError) as caught:
        chatglm_messages(request)
    assert caught.value.status == 400 and "JSON object" in caught.value.message


@pytest.mark.parametrize("request_, param", [
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(response_format={"type": "json_object"}), "response_format"),
    (chat(tools=[WEATHER], tool_choice="required"), "tool_choice"),
    (chat(logprobs=True, stream=True), "logprobs"),
    (CompletionRequest(model="tiny", prompt="hi", logprobs=2), "logprobs"),
    (CompletionRequest(model="tiny", prompt="hi", echo=True), "echo"),
])
def test_what_the_server_cannot_do_is_a_422_naming_the_parameter(request_, param):
    with pytest.raises(ApiError) as caught:
        refuse_unsupported(request_)
    assert (caught.value.status, caught.value.param, caught.value.code) == (422, param, "unsupported_value")


def test_what_it_can_do_passes():
    for request in (chat(logprobs=True, top_logprobs=0, response_format={"type": "text"}, tool_choice="auto"),
                    CompletionRequest(model="tiny", prompt=["a", "b"], logprobs=0)):
        refuse_unsupported(request)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": -1}, "max_tokens"), ({"temperature": 3}, "temperature"), ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"), ({"seed": -1}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_out_of_range_fields_are_400s_naming_the_field(fields, param):
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    error = validation_error(caught.value.errors())
    assert (error.status, error.param, error.body()["error"]["type"]) == (400, param, "invalid_request_error")


def pieces(reply: ChoiceText, *texts: str) -> list[str]:
    return [reply.add(Piece(text, 1, ())) for text in texts]


def test_text_that_may_begin_a_stop_string_waits_and_the_answer_ends_before_it():
    reply = ChoiceText(stops=("blue",), tool_names=(), limit=50)
    assert pieces(reply, "The sky is b", "l", "ue.", " More") == ["The sky is ", "", "", ""]
    assert reply.text == "The sky is " and reply.finish() == ("", None) and reply.finish_reason(None) == "stop"
    ended = ChoiceText(stops=("blue",), tool_names=(), limit=50)
    assert pieces(ended, "Grass is b", "right") == ["Grass is ", "bright"]


def test_a_reply_that_used_its_token_limit_finished_by_length():
    reply = ChoiceText(stops=(), tool_names=(), limit=2)
    pieces(reply, "The", " sky")
    assert reply.finish_reason(None) == "length"


def test_a_tool_call_is_held_back_and_answered_as_a_call():
    reply = ChoiceText(stops=(), tool_names=("get_weather",), limit=50)
    assert pieces(reply, "get_", "weather\n", "```python\ntool_call(city='Beijing')\n```") == ["", "", ""]
    text, call = reply.finish()
    assert (text, call) == ("", {"name": "get_weather", "parameters": {"city": "Beijing"}})
    assert reply.finish_reason(call) == "tool_calls"


def test_a_reply_that_only_starts_like_a_tool_name_is_sent_as_text():
    reply = ChoiceText(stops=(), tool_names=("get_weather",), limit=50)
    assert pieces(reply, "get", " it yourself") == ["", "get it yourself"]
    unknown = ChoiceText(stops=(), tool_names=("get_weather",), limit=50)
    pieces(unknown, "get_weather\n", "It is sunny.")
    assert unknown.finish() == ("get_weather\nIt is sunny.", None)


@pytest.mark.parametrize("backend, models, expected", [
    ("python", ("ensemble", "tensorrt_llm_bls"), "ensemble"),  # exact streaming, and no BLS stub under gRPC load
    ("tensorrtllm", ("ensemble", "tensorrt_llm_bls"), "tensorrt_llm_bls"),  # only BLS streams exact text there
    ("tensorrtllm", ("ensemble",), "ensemble"),
    ("python", ("tensorrt_llm_bls",), "tensorrt_llm_bls"),
    ("python", (), None),
])
def test_the_api_answers_through_the_model_that_streams_exact_text(tmp_path, backend, models, expected):
    for name, text in [("tensorrt_llm", f'name: "tensorrt_llm"\nbackend: "{backend}"\n'),
                       *((m, f'name: "{m}"\n') for m in models)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(text)
    assert client_model(tmp_path) == expected


def test_a_request_is_one_sampling_config_sent_as_the_ensembles_inputs():
    request = chat(temperature=0.8, top_p=0.9, seed=2**63 - 1, presence_penalty=0.5, n=2)
    assert request.sampling_config(1) == SamplingConfig(temperature=0.8, top_p=0.9, seed=0, presence_penalty=0.5)
    arrays = triton_inputs(Ask([{"role": "user", "content": "hi"}], 16, request.sampling_config(0), OutputConfig(),
                               (), False))
    assert {name: array.tolist() for name, array in arrays.items() if name != "text_input"} == {
        "max_tokens": [[16]], "stream": [[False]], "temperature": [[pytest.approx(0.8)]], "top_k": [[0]],
        "top_p": [[pytest.approx(0.9)]], "random_seed": [[2**63 - 1]], "presence_penalty": [[0.5]]}
    assert arrays["random_seed"].dtype.name == "uint64" and arrays["top_k"].dtype.name == "int32"
    greedy = triton_inputs(Ask([], 4, chat(temperature=0).sampling_config(), OutputConfig(True), (), True))
    assert set(greedy) == {"text_input", "max_tokens", "stream", "return_log_probs"}  # greedy: TensorRT-LLM's default
    # min_tokens (vLLM's extension, which genai-perf sends) is the ensemble's min_length
    held = triton_inputs(Ask([], 16, chat(temperature=0, min_tokens=16).sampling_config(), OutputConfig(), (), False))
    assert held["min_length"].tolist() == [[16]] and held["min_length"].dtype.name == "int32"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, fixture_dir):
    """Repositories of the fixture's engine as ChatGLM3 and as a ChatGLM2 engine would be rendered."""
    root = tmp_path_factory.mktemp("served")
    return {version: patch_repo(make_engine(root / version, "torch", fixture_dir, model={"chatglm_version": version}),
                                fixture_dir, root / version / "repo") for version in ("chatglm3", "chatglm2")}


@pytest.mark.parametrize("version, prompt_ids", [("chatglm3", chat_ids), ("chatglm2", chatglm2_ids)])
def test_prompts_are_counted_in_the_engines_own_format(rendered, fixture_dir, version, prompt_ids):
    served = served_model(rendered[version])
    tokenizer = ChatGLMTokenizer(fixture_dir)
    messages = [{"role": "user", "content": "What color is the sky?"}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "And the grass?"}]
    api = Api(served, triton=None, tokenizer=tokenizer)
    assert served.limits.chatglm_version == version and served.trtglm_engine
    assert api.prompt_length(messages, "messages") == len(prompt_ids(tokenizer, messages))
    assert len(chatglm2_ids(tokenizer, messages)) != len(chat_ids(tokenizer, messages))


@pytest.mark.parametrize("fields, asked", [({}, False), ({"logprobs": True}, True)])
def test_log_probs_are_asked_for_only_when_the_client_asks(rendered, fixture_dir, fields, asked):
    api = Api(served_model(rendered["chatglm3"]), triton=None, tokenizer=ChatGLMTokenizer(fixture_dir))
    ask, = api.asks(chat(**fields), [{"role": "user", "content": "hi"}], 8)
    assert ask.output.return_log_probs is asked and ("return_log_probs" in triton_inputs(ask)) is asked
    completion = CompletionRequest(model="tiny", prompt="hi", **({"logprobs": 0} if asked else {}))
    assert api.asks(completion, [], 8)[0].output.return_log_probs is asked
    nvidia = dataclasses.replace(api.served, trtglm_engine=False)  # its engine sends log probs only when asked
    assert Api(nvidia, None, api.tokenizer).asks(chat(**fields), [], 8)[0].output.return_log_probs


def test_tokens_are_counted_from_every_response_with_or_without_log_probs():
    reply = ChoiceText(stops=(), tool_names=(), limit=3)
    reply.add(Piece("The", 1, ()))
    reply.add(Piece("", 1, ()))  # a byte of a character still to come
    reply.add(Piece(" sky", 1, ()))
    assert reply.tokens == 3 and reply.log_probs == [] and reply.finish_reason(None) == "length"


# --- limits ------------------------------------------------------------------------------------------------


def test_the_choice_limit_is_the_repositorys_max_return_sequences(rendered, fixture_dir):
    """serve.max_return_sequences (8 by default) reaches the API through the rendered repository: n and best_of above
    it are 400s naming the field, before any prompt is tokenized; n at it passes."""
    api = Api(served_model(rendered["chatglm3"]), triton=None, tokenizer=ChatGLMTokenizer(fixture_dir))
    assert api.served.max_return_sequences == 8
    too_many = ((chat(n=9), "n"), (CompletionRequest(model="tiny", prompt="hi", n=2, best_of=10), "best_of"),
                (chat(n=10**6), "n"))
    for request, param in too_many:
        with pytest.raises(ApiError) as caught:
            api.check_counts(request)
        assert (caught.value.status, caught.value.param) == (400, param)
        assert "is more than this server allows (8, its serve.max_return_sequences)" in caught.value.message
    api.check_counts(chat(n=8))
    with pytest.raises(ApiError, match="best_of 3 above n 2 is not supported") as caught:
        refuse_unsupported(CompletionRequest(model="tiny", prompt="hi", n=2, best_of=3))
    assert caught.value.status == 422


@pytest.mark.parametrize("fields, param", [
    ({"stop": "x" * (MAX_STOP_BYTES + 1)}, "stop"), ({"stop": ["a", "x" * 10**6]}, "stop"),
    ({"prompt": ["hi"] * (MAX_PROMPTS + 1)}, "prompt"), ({"prompt": ["hi"] * 4000, "n": 16}, "prompt"),
])
def test_prompts_and_stop_strings_are_bounded(fields, param):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest(model="tiny", **{"prompt": "hi", **fields})
    assert validation_error(caught.value.errors()).param == param


def test_min_tokens_above_the_answers_limit_is_a_400(rendered, fixture_dir):
    api = Api(served_model(rendered["chatglm3"]), triton=None, tokenizer=ChatGLMTokenizer(fixture_dir))
    messages = [{"role": "user", "content": "hi"}]
    assert len(api.asks(chat(min_tokens=8), messages, limit=8)) == 1
    with pytest.raises(ApiError, match="min_tokens 9 is more than the answer may take \\(8 tokens") as caught:
        api.asks(chat(min_tokens=9), messages, limit=8)
    assert (caught.value.status, caught.value.param) == (400, "min_tokens")


def test_stop_strings_are_bounded_in_bytes(rendered, fixture_dir):
    api = Api(served_model(rendered["chatglm3"]), triton=None, tokenizer=ChatGLMTokenizer(fixture_dir))
    request = chat(stop="字" * (MAX_STOP_BYTES // 3 + 1))  # within the limit in characters, past it in bytes
    with pytest.raises(ApiError, match=f"at most {MAX_STOP_BYTES} bytes, not {3 * (MAX_STOP_BYTES // 3 + 1)}"):
        api.check_counts(request)
    api.check_counts(chat(stop="字" * (MAX_STOP_BYTES // 3)))


class StreamError:
    """tritonclient's error as a gRPC stream gives it: a message, no status."""

    def __init__(self, message: str, status: str | None = None):
        self._message, self._status = message, status

    def message(self) -> str:
        return self._message

    def status(self) -> str | None:
        return self._status


@pytest.mark.parametrize("error", [
    StreamError("in ensemble 'ensemble', busy: 9 requests are already being served or waiting (the queue is full); "
                "retry later"),
    StreamError("in ensemble 'ensemble', [request id: <id_unknown>] Exceeds maximum queue size"),
    StreamError("busy", "StatusCode.UNAVAILABLE"),
])
def test_a_full_queue_is_503_with_retry_after_whatever_path_refused_it(error):
    api_error = api_error_of(error)
    assert (api_error.status, api_error.code, api_error.headers()) == (503, "server_busy", {"Retry-After": "1"})
    assert api_error.message.startswith("the model server is busy, retry later: ")


def test_other_triton_errors_keep_their_status():
    assert api_error_of(StreamError("max_tokens is required", "StatusCode.INVALID_ARGUMENT")).status == 400
    assert api_error_of(StreamError("in ensemble 'ensemble', something broke")).status == 500
