"""CPU topologies as the kernel lists them, for the tests of the engines' cores and the replicas' shares."""

from __future__ import annotations

from pathlib import Path


def topology(root: Path, siblings: dict[int, str]) -> Path:
    """A /sys/devices/system/cpu look-alike: each CPU's thread_siblings_list."""
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(listed + "\n")
    return root


def hyperthreaded(root: Path, cores: int) -> Path:
    """`cores` physical cores of two threads each, numbered as Linux numbers them: cpu N and N + cores."""
    return topology(root, {cpu: f"{cpu % cores},{cpu % cores + cores}" for cpu in range(2 * cores)})
