"""`python -m trtglm.bench.replicas DEST`: each replica count's result against one replica's."""

from __future__ import annotations

import json

from trtglm.bench.replicas import report


def write(dest, replicas: int, tokens: float, p99: float) -> None:
    folder = dest / f"replicas-{replicas}"
    folder.mkdir()
    (folder / "replicas.json").write_text(json.dumps({
        "replicas": replicas, "in_flight": 256 * replicas, "tokens_per_s": tokens, "ttft_p50_ms": 100.0,
        "ttft_p99_ms": p99, "failed": 0}))


def test_each_count_is_compared_with_one_replica_and_its_target(tmp_path):
    write(tmp_path, 1, 18_000.0, 600.0)
    write(tmp_path, 2, 35_000.0, 590.0)
    write(tmp_path, 4, 63_000.0, 700.0)
    rows = report(tmp_path)[2:]
    assert rows == ["| 1 | 256 | 18,000 | 1.00× |  | 100.0 | 600.0 |  | 0 |",
                    "| 2 | 512 | 35,000 | 1.94× | ≥ 1.9× | 100.0 | 590.0 | yes | 0 |",
                    "| 4 | 1024 | 63,000 | 3.50× | ≥ 3.7× | 100.0 | 700.0 | NO | 0 |"]
