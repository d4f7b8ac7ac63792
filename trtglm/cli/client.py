"""`generate`: ask a served model and print its answer."""

from __future__ import annotations

import sys
from typing import Iterator

from trtglm.cli.flags import CountInt, PosFloat, PosInt
from trtglm.client import DEFAULT_URL


def generate(prompt: str, url: str = DEFAULT_URL, max_tokens: PosInt = 64, stream: bool = False,
             grpc: str | None = None, model: str = "ensemble", temperature: float | None = None,
             top_k: CountInt | None = None, top_p: float | None = None, seed: int | None = None,
             beam_width: PosInt | None = None, timeout: PosFloat = 600.0):
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


def _print_pieces(pieces: Iterator[str]) -> None:
    """Each piece as soon as it arrives; a line begun is ended even when the answer breaks off."""
    printed = False
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            printed = True
    except BaseException:
        if printed:
            print(flush=True)
        raise
    print(flush=True)
