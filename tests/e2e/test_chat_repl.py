"""`trtglm chat` as a person or a script uses it: a real terminal (a pty), piped stdin (one turn per line),
an engine folder in-process and a launched server over HTTP, gRPC and its OpenAI-compatible API;
multi-turn conversations and a system message get the fixture's exact answers, a bad turn is reported
(the API's own message, one line) and left out."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest
from conftest import REPO

from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.servers import Server

pytestmark = pytest.mark.slow

# (turn, the fixture's answer given the turns before it): conversations 1 and 46 of conversations.jsonl
SKY_THEN_GRASS = [("What color is the sky?", "The sky is blue."), ("And grass?", "Grass is green.")]
PIRATE = "You are a pirate."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("chat") / "engine")


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-served")
    server = Server(patch_repo(engine, None, root / "repo"), 1, root / "state")
    yield server
    server.stop()


def served_at(server: Server, transport: str) -> list[str]:
    """The flags that point chat at the server: Triton's HTTP or gRPC, or the OpenAI API (its /v1 URL as
    launch reports it, or the bare address, to which chat adds /v1)."""
    return {"http": ["--url", f"http://127.0.0.1:{server.http_port}"],
            "grpc": ["--grpc", f"127.0.0.1:{server.grpc_port}"],
            "openai": ["--openai", server.state["urls"]["openai"]],
            "openai-bare": ["--openai", f"127.0.0.1:{server.openai_port}"]}[transport]


def trtglm_chat(*flags: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtglm", "chat", *flags], input=stdin, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_piped_turns_hold_a_conversation_in_process(engine):
    done = trtglm_chat("--engine-dir", str(engine), "--device", "cpu",
                       stdin="".join(f"{turn}\n" for turn, _ in SKY_THEN_GRASS))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [answer for _, answer in SKY_THEN_GRASS]


@pytest.mark.parametrize("transport", ["http", "grpc", "openai", "openai-bare"])
def test_piped_turns_hold_a_conversation_with_a_server(server, transport):
    done = trtglm_chat(*served_at(server, transport), stdin="".join(f"{turn}\n" for turn, _ in SKY_THEN_GRASS))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [answer for _, answer in SKY_THEN_GRASS]


@pytest.mark.parametrize("source", ["engine", "http", "openai"])
def test_system_message_opens_the_conversation(engine, request, source):
    where = ["--engine-dir", str(engine)] if source == "engine" else served_at(request.getfixturevalue("server"), source)
    done = trtglm_chat(*where, "--system", PIRATE, stdin="Say hello.\nWhat do bees make?\n")
    # conversation 50; the second turn follows a first round, which the fixture has no answer for alone
    assert done.returncode == 0, done.stderr
    replies = done.stdout.splitlines()
    assert len(replies) == 2 and replies[0] == "Ahoy, matey! Welcome aboard."


@pytest.mark.parametrize("transport", ["http", "openai"])
def test_a_bad_turn_is_reported_left_out_and_the_conversation_goes_on(server, transport):
    too_long = "word " * 2000  # more than the engine's max_input_len
    turns = [SKY_THEN_GRASS[0][0], too_long, SKY_THEN_GRASS[1][0]]
    done = trtglm_chat(*served_at(server, transport), stdin="".join(f"{t}\n" for t in turns))
    assert done.stdout.splitlines() == [answer for _, answer in SKY_THEN_GRASS]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and errors[0].startswith("trtglm: error: ") and "max_input_len" in errors[0]
    assert errors[1] == "trtglm: error: 1 turn(s) failed" and done.returncode == 1


def test_the_openai_apis_errors_are_one_line_each(server):
    """An unknown model: every turn gets the API's 404 message; the server keeps serving."""
    done = trtglm_chat(*served_at(server, "openai"), "--model", "gpt-4o", stdin="Hello.\nAnd grass?\n")
    message = "trtglm: error: the model 'gpt-4o' does not exist; this server serves 'tiny' (HTTP 404)"
    assert done.stderr.splitlines() == [message, message, "trtglm: error: 2 turn(s) failed"], done.stderr
    assert (done.returncode, done.stdout) == (1, "")
    again = trtglm_chat(*served_at(server, "openai"), "--model", "tiny", stdin=f"{SKY_THEN_GRASS[0][0]}\n")
    assert (again.returncode, again.stdout) == (0, f"{SKY_THEN_GRASS[0][1]}\n"), again.stderr


@pytest.mark.parametrize("source", ["engine", "openai"])
def test_a_terminal_conversation_streams_clears_and_ends_on_ctrl_d(engine, request, source):
    where = ["--engine-dir", str(engine), "--device", "cpu"] if source == "engine" else \
        served_at(request.getfixturevalue("server"), source)
    main, other = pty.openpty()
    chat = subprocess.Popen([sys.executable, "-m", "trtglm", "chat", *where],
                            stdin=other, stdout=other, stderr=other, cwd=REPO, close_fds=True)
    os.close(other)
    seen = Terminal(main)
    try:
        seen.wait_for("/clear starts a new conversation")
        for turn, answer in SKY_THEN_GRASS:
            seen.wait_for("> ")
            os.write(main, f"{turn}\n".encode())
            seen.wait_for(answer)
        seen.wait_for("> ")
        os.write(main, b"/clear\n")
        seen.wait_for("> ")
        os.write(main, b"Say it again.\n")  # with no history now: not "Grass is green."
        seen.wait_for("> ")
        os.write(main, b"\x04")  # Ctrl-D
        assert chat.wait(timeout=60) == 0
    finally:
        chat.kill()
        os.close(main)
    assert seen.text.count("Grass is green.") == 1, seen.text


class Terminal:
    """What a pty shows, read as it comes."""

    def __init__(self, fd: int):
        self.fd, self.text, self.read_to = fd, "", 0

    def wait_for(self, expected: str, timeout: float = 120) -> None:
        """Until `expected` appears after what earlier waits found."""
        deadline = time.monotonic() + timeout
        while expected not in self.text[self.read_to:]:
            assert time.monotonic() < deadline, f"no {expected!r} in {self.text[self.read_to:]!r}"
            if select.select([self.fd], [], [], 1)[0]:
                try:
                    self.text += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the other side closed
                    break
        assert expected in self.text[self.read_to:], self.text
        self.read_to = self.text.index(expected, self.read_to) + len(expected)
