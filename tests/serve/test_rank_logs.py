"""rank_logs.FatalSignals on log folders laid out as launches write them: one rank's DIR/ranks/rank.0/, mpirun's
DIR/ranks/<job>/rank.N/."""

from __future__ import annotations

from pathlib import Path

from trtglm.serve.rank_logs import FatalSignals


def write(path: Path, text: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as log:
        log.write(text)


def test_a_fatal_signal_line_is_reported_once_with_its_rank(tmp_path):
    write(tmp_path / "ranks" / "rank.0" / "stderr", b"I1128 model loaded\n")
    signals = FatalSignals(tmp_path)
    assert signals.first() is None
    write(tmp_path / "ranks" / "rank.0" / "stderr", b"double free or corruption (out)\nSignal (6) received.\n")
    assert signals.first() == (0, 6)
    assert signals.first() is None  # read past it


def test_mpiruns_layout_gives_the_rank_and_a_line_being_written_waits_for_its_end(tmp_path):
    stderr = tmp_path / "ranks" / "1" / "rank.1" / "stderr"
    write(tmp_path / "ranks" / "1" / "rank.0" / "stderr", b"I1128 fine\n")
    write(stderr, b"Signal (11) rec")
    signals = FatalSignals(tmp_path)
    assert signals.first() is None
    write(stderr, b"eived.\n 0# 0x0000555B18C7F52D in tritonserver\n")
    assert signals.first() == (1, 11)


def test_a_stop_signal_on_stdout_and_lines_that_only_mention_one_are_not_fatal(tmp_path):
    write(tmp_path / "ranks" / "rank.0" / "stdout", b"Signal (15) received.\n")  # tritonserver's SIGTERM handler
    write(tmp_path / "ranks" / "rank.0" / "stderr", b"I1128 Signal (6) received. in a message\nWSignal (6) received.\n")
    assert FatalSignals(tmp_path).first() is None
