"""The API's /metrics: one Prometheus text of its own families and, where a launch runs it, Triton's beside them.

- its own: the sequences waiting and running in the API's line and the requests it refused (admission.py);
- Triton's, read from Triton's metrics URL at each scrape (no proxy: Triton runs beside it): trtglm's engine
  families, NVIDIA's `nv_trt_llm_*` and Triton's `nv_inference_*`. The Gateway API Inference Extension's endpoint
  picker reads a server's queue and KV-cache metrics on the port it sends requests to, this one.

Each family appears once: one of Triton's that bears a name of the API's own is left out. When Triton's metrics do
not answer, the API's own are served alone (the scrape still tells the API's line), and the log says so once.
"""

from __future__ import annotations

import logging
import urllib.request

from trtglm.openai_api.admission import Admission

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format
TRITON_TIMEOUT_S = 5.0


def own_metrics(admission: Admission) -> str:
    """The API's own families, in Prometheus' text format."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    sequences = Gauge("trtglm_openai_sequences", "the API's sequences (choices of prompts) by state", ["state"],
                      registry=registry)
    sequences.labels("running").set(admission.running)
    sequences.labels("waiting").set(admission.waiting)
    Gauge("trtglm_openai_waiting_limit", "the most sequences that may wait; a request beyond it gets 429",
          registry=registry).set(admission.waiting_limit)
    Counter("trtglm_openai_refused_requests", "requests refused (429) because the waiting line was full",
            registry=registry).inc(admission.refused)
    return generate_latest(registry).decode()


def read_triton_metrics(url: str) -> str:
    """Triton's metrics text; OSError when it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=TRITON_TIMEOUT_S) as reply:
        return reply.read().decode()


def families(text: str) -> dict[str, list[str]]:
    """The lines of each metric family of a Prometheus text, by family name, in order. A family is named by its
    `# HELP` or `# TYPE` line, and holds the samples after it whose names begin with its name; a sample that
    follows none is a family of its own."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        words = line.split(maxsplit=3)
        if words[0] == "#":
            if len(words) < 3 or words[1] not in ("HELP", "TYPE"):
                continue  # a comment
            current = words[2]
        else:
            name = line.split("{", 1)[0].split(maxsplit=1)[0]
            if current is None or not name.startswith(current):
                current = name
        found.setdefault(current, []).append(line)
    return found


def merged(own: str, triton: str) -> str:
    """`own` families, then those of `triton` whose names `own` does not hold."""
    kept = families(own)
    theirs = families(triton)
    clashes = [name for name in theirs if name in kept]
    if clashes:
        log.debug("Triton's metrics also name %s: the API's own are served", ", ".join(clashes))
    extra = [line for name, lines in theirs.items() if name not in kept for line in lines]
    return own.rstrip("\n") + "\n" + "".join(f"{line}\n" for line in extra)


class MetricsPage:
    """What the API's /metrics answers: its own families, with Triton's at `triton_url` when given."""

    def __init__(self, admission: Admission, triton_url: str | None):
        self.admission, self.triton_url = admission, triton_url
        self.triton_answers = True  # as last seen: a change is logged once

    def text(self) -> str:
        own = own_metrics(self.admission)
        if self.triton_url is None:
            return own
        try:
            triton = read_triton_metrics(self.triton_url)
        except OSError as e:
            if self.triton_answers:
                log.warning("Triton's metrics (%s) did not answer: %s; serving the API's own alone", self.triton_url, e)
            self.triton_answers = False
            return own
        if not self.triton_answers:
            log.info("Triton's metrics answer again")
        self.triton_answers = True
        return merged(own, triton)
