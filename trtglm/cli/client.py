"""`generate`: ask a served model and print its answer; `chat`: a conversation with an engine or a server."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Iterator, Literal

from trtglm.cli.flags import CountInt, PosFloat, PosInt
from trtglm.client import ANSWER_TIMEOUT_S
from trtglm.errors import TrtglmError, UsageError
from trtglm.ports import LOCAL_URL


def generate(prompt: str, url: str = LOCAL_URL, max_tokens: PosInt = 64, stream: bool = False,
             grpc: str | None = None, model: str = "ensemble", temperature: float | None = None,
             top_k: CountInt | None = None, top_p: float | None = None, seed: int | None = None,
             beam_width: PosInt | None = None, timeout: PosFloat = ANSWER_TIMEOUT_S):
    """Ask a served model (ensemble or tensorrt_llm_bls) and print its answer; --stream prints it as it arrives.

    --prompt: text, or a JSON chat (a list of {role, content} messages or {"messages": [...]}).
    Over HTTP (--url) the answer comes from /generate, or with --stream from /generate_stream;
    --grpc HOST:PORT uses Triton's gRPC stream instead. --temperature, --top-k, --top-p, --seed,
    --beam-width are sent only when given; with --beam-width N every beam is printed, best first, one a
    line (beams are not streamed). --timeout: seconds to wait for the server.
    """
    from trtglm.client import GenerateRequest, check_model

    request = GenerateRequest(prompt, max_tokens, stream=stream, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, beam_width=beam_width)
    check_model(model)
    _print_pieces(_pieces(url, grpc, model, request, timeout))


def _pieces(url: str, grpc: str | None, model: str, request, timeout: float) -> Iterator[str]:
    if grpc is not None:
        from trtglm.client.grpc import check_address, generate_stream

        check_address(grpc)
        return generate_stream(grpc, model, request, timeout)
    from trtglm.client import http

    http.Server.parse(url)  # a bad --url is reported before anything is sent
    if request.stream:
        return http.generate_stream(url, model, request, timeout)
    return iter([http.generate(url, model, request, timeout)])


def _print_pieces(pieces: Iterator[str]) -> str:
    """Each piece as soon as it arrives; a line begun is ended even when the answer breaks off. The whole text."""
    printed = []
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            printed.append(piece)
    except BaseException:
        if printed:
            print(flush=True)
        raise
    print(flush=True)
    return "".join(printed)


# --- chat ------------------------------------------------------------------------------------------

Replier = Callable[[Sequence[dict]], Iterator[str]]  # a conversation -> the reply's pieces as they come
COMMANDS_HELP = "/clear starts a new conversation, /exit (or Ctrl-D) ends"


def chat(engine_dir: str | None = None, url: str | None = None, grpc: str | None = None, openai: str | None = None,
         checkpoint: str | None = None, tokenizer_dir: str | None = None, prompt: str | None = None,
         system: str | None = None, model: str | None = None, max_tokens: PosInt = 256,
         temperature: float = 0.0, top_k: CountInt = 0, top_p: PosFloat = 1.0, seed: CountInt | None = None,
         device: Literal["auto", "cpu", "cuda"] = "auto", timeout: PosFloat = ANSWER_TIMEOUT_S):
    """Chat with ChatGLM3: an engine folder in-process, or a served repository; replies stream as they come.

    What answers: --engine-dir ENG (trtglm's runtime on the engine's checkpoint, on the GPU when
    there is one: --device), --checkpoint CKPT with --tokenizer-dir HF, or a server: --url
    http://HOST:PORT (Triton's HTTP generate_stream) or --grpc HOST:PORT, asking --model
    (tensorrt_llm_bls, the default, or ensemble) with the whole conversation as a JSON chat; or
    --openai http://HOST:PORT/v1, an OpenAI-compatible API (launch's, or any other) asked through
    /v1/chat/completions with the whole conversation as its messages, for --model (default: the one
    model it lists; --top-k is not part of that API).
    --prompt TEXT answers one turn (text or a JSON chat) and exits. Otherwise each line read is a
    user turn and the conversation goes on (at a terminal: /clear starts over, /exit or Ctrl-D ends);
    --system TEXT opens it with a system message. A turn that fails is reported and left out of the
    conversation; the exit code is then 1.
    """
    sources = {"--engine-dir": engine_dir, "--url": url, "--grpc": grpc, "--openai": openai, "--checkpoint": checkpoint}
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    replier = _replier(sources, tokenizer_dir, model, sampling, device, timeout)
    opening = [] if system is None else [{"role": "system", "content": system}]
    if prompt is not None:
        from trtglm.chatglm.chat import chat_messages

        _print_pieces(replier([*opening, *chat_messages(prompt, name="--prompt")]))
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"trtglm chat: {COMMANDS_HELP}", file=sys.stderr)
    failed = converse(replier, _turns(interactive), opening, interactive)
    if failed:
        raise TrtglmError(f"{failed} turn(s) failed")


def converse(replier: Replier, turns: Iterable[str], opening: list[dict], interactive: bool) -> int:
    """Answer each turn in order, each reply printed as it comes; returns how many turns failed."""
    messages, failed = list(opening), 0
    for turn in turns:
        if interactive and turn.strip() in ("/exit", "/quit"):
            break
        if interactive and turn.strip() == "/clear":
            messages = list(opening)
            continue
        if not turn.strip():
            continue
        asked = [*messages, {"role": "user", "content": turn}]
        try:
            reply = _print_pieces(replier(asked))
        except TrtglmError as e:
            print(f"trtglm: error: {e}", file=sys.stderr, flush=True)
            failed += 1
            continue
        messages = [*asked, {"role": "assistant", "content": reply}]
    return failed


def _turns(interactive: bool) -> Iterator[str]:
    """User turns: at a terminal as typed after a `> ` prompt, else one per line read."""
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\r\n")
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print(file=sys.stderr)
            return


def _replier(sources: dict[str, str | None], tokenizer_dir, model, sampling: dict, device, timeout) -> Replier:
    given = [flag for flag, value in sources.items() if value is not None]
    if len(given) != 1:
        raise UsageError(f"chat needs one of {', '.join(sources)} (given: {', '.join(given) or 'none'})")
    checkpoint = sources["--checkpoint"]
    if (checkpoint is None) != (tokenizer_dir is None):
        raise UsageError("--checkpoint and --tokenizer-dir go together")
    if sources["--openai"] is not None:
        return _openai(sources["--openai"], model, sampling, timeout)
    if sources["--url"] is not None or sources["--grpc"] is not None:
        return _served(sources["--url"], sources["--grpc"], model or "tensorrt_llm_bls", sampling, timeout)
    if sources["--engine-dir"] is not None:
        from trtglm.engine.manifest import read_manifest

        manifest = read_manifest(sources["--engine-dir"])
        checkpoint, tokenizer_dir = manifest.checkpoint_dir, manifest.tokenizer_dir
    from trtglm.runtime.answer import LocalChat

    return LocalChat(checkpoint, tokenizer_dir, **sampling, device=_device(device)).pieces


def _request_options(sampling: dict) -> dict:
    """The sampling options as a served model takes them (checked before the first turn; defaults left out)."""
    from trtglm.client import GenerateRequest

    options = dict(max_tokens=sampling["max_tokens"], stream=True, temperature=sampling["temperature"] or None,
                   top_k=sampling["top_k"] or None, top_p=None if sampling["top_p"] == 1 else sampling["top_p"],
                   seed=sampling["seed"])
    GenerateRequest("check", **options)
    return options


def _served(url, grpc, model, sampling: dict, timeout) -> Replier:
    from trtglm.chatglm.chat import chat_text
    from trtglm.client import GenerateRequest, check_model

    check_model(model)
    options = _request_options(sampling)

    def pieces(messages: Sequence[dict]) -> Iterator[str]:
        request = GenerateRequest(chat_text(messages), **options)
        return _pieces(url or LOCAL_URL, grpc, model, request, timeout)

    return pieces


def _openai(url, model, sampling: dict, timeout) -> Replier:
    from trtglm.client.openai_chat import OpenAIChat

    options = _request_options(sampling)
    if options["top_k"] is not None:
        raise UsageError("--top-k is not part of the OpenAI API: leave it out with --openai")
    return OpenAIChat(url, model, options["max_tokens"], sampling["temperature"], options["top_p"], options["seed"],
                      timeout).pieces


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
