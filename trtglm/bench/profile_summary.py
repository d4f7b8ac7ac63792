"""Where a process's time went, from a py-spy profile (`py-spy record --format raw`: one line per stack,
`frame;frame;…;frame COUNT`, outermost first): the frames with the most samples, their own and with what they
call, as shares of all samples.

    python -m trtglm.bench.profile_summary PROFILE [--top N]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def summarise(lines: list[str]) -> tuple[int, Counter[str], Counter[str]]:
    """(all samples, samples per frame at the top of its stack, samples per frame anywhere in its stack)."""
    total, own, inclusive = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    return total, own, inclusive


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trtglm.bench.profile_summary")
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    total, own, inclusive = summarise(args.profile.read_text().splitlines())
    if not total:
        raise SystemExit(f"{args.profile}: no samples")
    for title, counts in (("own samples", own), ("with what they call", inclusive)):
        print(f"py-spy, {total} samples: frames by {title}")
        for frame, count in counts.most_common(args.top):
            print(f"  {100 * count / total:5.1f} %  {frame}")


if __name__ == "__main__":
    main()
