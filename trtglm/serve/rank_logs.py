"""The ranks' log files: where each rank's stdout and stderr lie, the lines worth showing when a launch
fails (the last error lines, then the tail), the last error a rank logged, and whether a rank's tritonserver
reported a fatal signal."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

TAIL_LINES = 30
ERROR_LINE = re.compile(r"^(E\d{4} |error: |Traceback |\w+(Error|Exception): )")
# What tritonserver's handler of SIGSEGV and SIGABRT writes to stderr before a stack trace, after which it dies of
# the signal. With a corrupted heap the stack trace can hang it for good (seen: "double free or corruption", then
# this line alone, the server never answering again). Its SIGTERM and SIGINT handler writes to stdout.
UNCAUGHT = re.compile(r"terminate called after throwing an instance of '([^']+)'")  # the C++ runtime's words
SUPERVISOR_ERROR = "trtglm: error: "  # how a detached supervisor's log gives the error it ended with
FATAL_SIGNAL = re.compile(r"Signal \((\d+)\) received\.")
# What a rank agent (rank_agent.py, ranks on several hosts) says when its rank must end; mpirun brings it to mpirun.log.
AGENT_REPORT = re.compile(r"trtglm rank (\d+) on (\S+): (.*); stopping this rank")


def rank_logs(log_dir: Path, rank: int) -> list[Path]:
    """A rank's stdout and stderr files (mpirun's DIR/ranks/<job>/rank.N/ or DIR/ranks/rank.0/)."""
    return sorted(Path(log_dir).glob(f"ranks/**/rank.{rank}/std*"))


def log_excerpt(text: str, tail: int = TAIL_LINES, errors: int = 10) -> list[str]:
    """The last `tail` lines, preceded by the last `errors` error lines above them (Triton's E-lines,
    `error:` lines, Python exceptions): a failing model's message is often followed by a long
    shutdown report."""
    lines = text.splitlines()
    head, last = lines[:-tail], lines[-tail:]
    found = [line for line in head if ERROR_LINE.match(line)][-errors:]
    return [*found, "...", *last] if found else last


def last_error_line(log_dir: Path, rank: int) -> str | None:
    """The last error a rank logged (a Triton E-line, a Python exception, a C++ `what():`), stripped."""
    found = None
    for path in rank_logs(log_dir, rank):
        for line in read_log(path).splitlines():
            text = line.strip().removeprefix("what():").strip()
            if ERROR_LINE.match(text):
                found = text
    return found


def supervisor_error(log_path: Path) -> str | None:
    """The error a detached supervisor ended with (its last `trtglm: error: ` line), without that prefix."""
    errors = [line for line in read_log(log_path).splitlines() if line.startswith(SUPERVISOR_ERROR)]
    return errors[-1][len(SUPERVISOR_ERROR):] if errors else None


def first_abort(log_dir: Path, rank: int) -> str | None:
    """How a rank's tritonserver first said it was aborting (an uncaught C++ exception, a fatal signal), if it
    did: the first cause, not the errors its stubs logged as it went down."""
    for path in rank_logs(log_dir, rank):
        for line in read_log(path).splitlines():
            thrown = UNCAUGHT.search(line)
            if thrown:
                return f"tritonserver aborted: uncaught {thrown.group(1)}"
            signalled = FATAL_SIGNAL.fullmatch(line.strip())
            if signalled:
                return f"tritonserver received {signal_name(int(signalled.group(1)))}"
    return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def agent_report(rank: int, host: str, why: str, folder: Path) -> str:
    return f"trtglm rank {rank} on {host}: {why}; stopping this rank (logs: {folder})"


def rank_death(log_dir: Path, rank: int, world_size: int) -> tuple[int, str]:
    """The rank that died and what to say of it: what a rank agent on its host reported in mpirun.log (ranks on
    several hosts), else `rank`, as the supervisor saw it die, and how its tritonserver first said it was aborting."""
    found = AGENT_REPORT.search(read_log(Path(log_dir) / "mpirun.log"))
    if found is None:
        abort = first_abort(log_dir, rank)
        return rank, f"rank {rank} of {world_size} died{f' ({abort})' if abort else ''}"
    return int(found.group(1)), f"rank {found.group(1)} of {world_size} on {found.group(2)}: {found.group(3)}"


def read_log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def print_tails(log_dir: Path, ranks: list[int]) -> None:
    """To stderr: mpirun's notes about ranks, then an excerpt of each of `ranks`' logs."""
    mpirun_log = log_dir / "mpirun.log"
    notes = [line for line in read_log(mpirun_log).splitlines() if "rank" in line or "exited" in line]
    if notes:
        print(f"---- {mpirun_log} ----", *notes, sep="\n", file=sys.stderr)
    for rank in ranks:
        for path in rank_logs(log_dir, rank):
            print_excerpt(path, f"rank {rank}: ")


def print_excerpt(path: Path, title: str = "") -> None:
    """To stderr: an excerpt of one log (`log_excerpt`), under a line naming it."""
    lines = log_excerpt(read_log(path))
    if lines:
        print(f"---- {title}{path} ----", *lines, sep="\n", file=sys.stderr)


class LogTail:
    """The new complete lines of the files under `folder` that match `pattern`, read as the files grow."""

    def __init__(self, folder: Path, pattern: str):
        self.folder, self.pattern = Path(folder), pattern
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}  # a file's last line, not yet ended

    def new_lines(self) -> list[tuple[Path, str]]:
        lines = []
        for path in sorted(self.folder.glob(self.pattern)):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            *complete, rest = (self.partial.pop(path, b"") + data).split(b"\n")
            if rest:
                self.partial[path] = rest
            lines += [(path, line.decode("utf-8", errors="replace")) for line in complete]
        return lines


class FatalSignals:
    """The ranks' stderr files, read as they grow, for FATAL_SIGNAL lines."""

    def __init__(self, log_dir: Path):
        self.tail = LogTail(log_dir, "ranks/**/rank.*/stderr")

    def first(self) -> tuple[int, int] | None:
        """(rank, signal number) of the first fatal signal reported since the last call, if any."""
        for path, line in self.tail.new_lines():
            found = FATAL_SIGNAL.fullmatch(line)
            if found:
                return int(path.parent.name.removeprefix("rank.")), int(found.group(1))
        return None
