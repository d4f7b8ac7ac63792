"""Served tokens/s at each world size against world size 1, from the results `scripts/bench_gpu.sh`'s
`worldsizes` part leaves: DEST/worldsizes-ws{N}-at{in flight}/sampling.json (`trtglm bench sampling`).

    python -m trtglm.bench.world_sizes DEST
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (world size, requests in flight) -> the least tokens/s over world size 1's (at its fewest in flight: 64) to reach
TARGETS = {(2, 64): 1.4, (4, 64): 1.8, (4, 256): 2.5}
RESULT = re.compile(r"worldsizes-ws(\d+)-at(\d+)$")


def read_results(dest: Path) -> dict[tuple[int, int], dict[str, float]]:
    """(world size, in flight) -> tokens/s of each case."""
    results = {}
    for folder in sorted(dest.iterdir()):
        match = RESULT.match(folder.name)
        if match and (folder / "sampling.json").is_file():
            cases = json.loads((folder / "sampling.json").read_text())["cases"]
            results[int(match[1]), int(match[2])] = {name: case["tokens_per_s"] for name, case in cases.items()}
    return results


def report(results: dict[tuple[int, int], dict[str, float]]) -> list[str]:
    base_in_flight = min((in_flight for world, in_flight in results if world == 1), default=None)
    base = results.get((1, base_in_flight), {})
    lines = [f"| world size | in flight | case | tokens/s | vs world size 1 at {base_in_flight} | target |",
             "|---:|---:|---|---:|---:|---:|"]
    for (world, in_flight), cases in sorted(results.items()):
        for name, tokens in cases.items():
            ratio = f"{tokens / base[name]:.2f}×" if base.get(name) else "–"
            target = TARGETS.get((world, in_flight))
            lines.append(f"| {world} | {in_flight} | {name} | {tokens:,.0f} | {ratio} | "
                         f"{f'≥ {target}×' if target else ''} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trtglm.bench.world_sizes")
    parser.add_argument("dest", type=Path)
    results = read_results(parser.parse_args().dest)
    if not results:
        raise SystemExit("no worldsizes-ws*-at*/sampling.json results there")
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
