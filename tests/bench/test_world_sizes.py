import json

from trtglm.bench.world_sizes import read_results, report


def write(dest, world, in_flight, greedy, top_p):
    folder = dest / f"worldsizes-ws{world}-at{in_flight}"
    folder.mkdir()
    cases = {"greedy": {"tokens_per_s": greedy}, "top-p": {"tokens_per_s": top_p}}
    (folder / "sampling.json").write_text(json.dumps({"cases": cases}))


def test_each_world_size_is_held_against_world_size_one_at_64(tmp_path):
    write(tmp_path, 1, 64, 8000.0, 7000.0)
    write(tmp_path, 2, 64, 12000.0, 10500.0)
    write(tmp_path, 4, 256, 24000.0, 14000.0)
    (tmp_path / "worldsizes.txt").write_text("not a result")
    results = read_results(tmp_path)
    assert results == {(1, 64): {"greedy": 8000.0, "top-p": 7000.0}, (2, 64): {"greedy": 12000.0, "top-p": 10500.0},
                       (4, 256): {"greedy": 24000.0, "top-p": 14000.0}}
    lines = report(results)
    assert "| 2 | 64 | greedy | 12,000 | 1.50× | ≥ 1.4× |" in lines
    assert "| 4 | 256 | top-p | 14,000 | 2.00× | ≥ 2.5× |" in lines
    assert "| 1 | 64 | greedy | 8,000 | 1.00× |  |" in lines
