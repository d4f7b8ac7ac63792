"""deploy/kubernetes/ against a real CPU launch of the tiny fixture (started once for this module, as the pods
start it: `trtglm launch` behind its front, with a drain): the probes' paths answer 200 on the ports the manifests
name them by; every metric that the recording rules, the autoscalers and the endpoint picker read is on the /metrics
they scrape (the OpenAI API's port: the API's families and Triton's, each once) and follows the engine's load; and an
orderly stop, what a pod's SIGTERM starts, refuses new requests while it lets the streams in flight finish."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO
from support.manifests import FIXTURES, kustomizations, named, render, selectors, server_container, server_pods
from support.servers import NO_PROXY, Launched, launched_server

from trtglm.profile import load_profile

DRAIN_S = 30
LONG = 300  # output tokens of a request that keeps a slot for a while (min_tokens holds back the end)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("pytriton")
    yield from launched_server(tmp_path_factory.mktemp("served"), launch_flags=("--front", "--drain", str(DRAIN_S)))


@pytest.fixture(scope="module")
def manifests() -> list[list[dict]]:
    return [render(folder) for folder in kustomizations()[1:]]


def get(url: str) -> tuple[int, str]:
    try:
        with NO_PROXY.open(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as Prometheus reads it: (name, its labels) → value; no family may appear twice."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(url)
    assert status == 200
    found, names = {}, []
    for family in text_string_to_metric_families(text):
        names.append(family.name)
        found.update({(s.name, frozenset(s.labels.items())): s.value for s in family.samples})
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    return found


def scraped(served: Launched, objects: list[dict]) -> str:
    """The URL of what the PodMonitor scrapes (one endpoint) on the launch."""
    ((endpoint,),) = [monitor["spec"]["podMetricsEndpoints"] for monitor in named(objects, "PodMonitor")]
    return f"http://127.0.0.1:{served.ports[endpoint['port']]}{endpoint['path']}"


def replica_metrics(served: Launched) -> str:
    """Triton's own /metrics of the launch's one replica (behind the front)."""
    done = served.run("status", "--json")
    ((replica,),) = [row["replicas"] for row in json.loads(done.stdout)]
    return f"http://127.0.0.1:{replica['ports']['metrics']}/metrics"


def value(found: dict, name: str, **labels: str) -> float | None:
    """The value of the one series of `name` whose labels include `labels` (None: no such series)."""
    matching = [v for (n, have), v in found.items() if n == name and set(labels.items()) <= have]
    assert len(matching) <= 1, (name, labels)
    return matching[0] if matching else None


def test_every_probe_path_answers_200_on_the_port_it_names(served, manifests):
    checked = set()
    for objects in manifests:
        for pod in server_pods(objects):
            server = server_container(pod)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get_ = server[probe]["httpGet"]
                checked.add((get_["port"], get_["path"]))
        for monitor in named(objects, "PodMonitor"):
            checked |= {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]}
    assert {port for port, _ in checked} == {"http", "openai"}
    for port, path in sorted(checked):
        assert get(f"http://127.0.0.1:{served.ports[port]}{path}")[0] == 200, (port, path)


def test_every_metric_the_rules_and_the_picker_read_is_served_where_they_read_it(served, manifests):
    read = set()
    for objects in manifests:
        for rules in named(objects, "PrometheusRule"):
            for rule in (r for group in rules["spec"]["groups"] for r in group["rules"]):
                read |= {(name, frozenset(labels.items())) for name, labels in selectors(rule["expr"])}
    assert {name for name, _ in read} >= {"nv_trt_llm_request_metrics", "trtglm_openai_sequences"}
    (url,) = {scraped(served, objects) for objects in manifests}
    on_scraped = samples(url)
    for name, labels in sorted(read):
        assert value(on_scraped, name, **dict(labels)) is not None, (name, dict(labels))
    picker = json.loads((FIXTURES / "endpoint-picker-v1.5.0.json").read_text())["triton_tensorrt_llm_metrics"]
    on_inference_port = samples(f"http://127.0.0.1:{served.ports['openai']}/metrics")
    for spec in picker.values():
        ((name, labels),) = selectors(spec)
        assert value(on_inference_port, name, **labels) is not None, spec
    tritons = {n for n, _ in samples(replica_metrics(served))}  # Triton's, passed through beside the API's own
    assert any(n.startswith("nv_inference_") for n in tritons) and {n for n, _ in on_inference_port} >= tritons


def completion(served: Launched, tokens: int, stream: bool = False):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": tokens, "min_tokens": tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(f"{served.openai}/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return NO_PROXY.open(request, timeout=120)


def test_the_queue_slots_and_kv_cache_metrics_follow_the_engines_load(served, manifests):
    """12 requests of LONG tokens on an engine of 8 slots through the OpenAI API, which sends the engine its slots
    and a quarter more (admission.py): 8 run and 2 wait in the engine, 2 wait in the API's line (4 waiting in all, as
    the recording rule counts them); each running request holds the KV-cache blocks of its whole length from
    admission; the numbers hold together, and go back to 0 once all are done."""
    page = scraped(served, manifests[0])
    profile = load_profile(REPO / "configs" / "tiny.yaml")
    tokens_per, slots = profile.build.tokens_per_block, profile.build.max_batch_size
    blocks = slots * profile.build.max_seq_len // tokens_per  # the tiny engine's cache: every slot's whole length
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(samples(page))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            replies = [json.loads(r.read()) for r in pool.map(lambda _: completion(served, LONG), range(12))]
    finally:
        done.set()
        watcher.join()
    prompt = replies[0]["usage"]["prompt_tokens"]
    assert all(r["usage"]["completion_tokens"] == LONG for r in replies)
    each = math.ceil((prompt + LONG) / tokens_per)

    def numbers(found: dict) -> dict[str, float]:
        requests = {t: value(found, "nv_trt_llm_request_metrics", request_type=t)
                    for t in ("waiting", "scheduled", "active", "max")}
        cache = {t: value(found, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=t)
                 for t in ("used", "free", "max", "tokens_per", "fraction")}
        api = {f"api_{t}": value(found, "trtglm_openai_sequences", state=t) for t in ("waiting", "running")}
        return {**requests, **{f"kv_{t}": v for t, v in cache.items()}, **api}

    in_engine = slots + slots // 4
    full = {"waiting": in_engine - slots, "scheduled": slots, "active": in_engine, "max": slots,
            "kv_used": slots * each, "kv_free": blocks - slots * each, "kv_max": blocks, "kv_tokens_per": tokens_per,
            "kv_fraction": slots * each / blocks, "api_waiting": 12 - in_engine, "api_running": in_engine}
    assert any(numbers(found) == pytest.approx(full) for found in seen), [numbers(f) for f in seen[::10]]
    deadline = time.monotonic() + 5  # the gauges follow twice a second
    while (after := numbers(samples(page)))["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after == {**full, "waiting": 0, "scheduled": 0, "active": 0, "kv_used": 0, "kv_free": blocks,
                     "kv_fraction": 0, "api_waiting": 0, "api_running": 0}


def turned_away(served: Launched) -> bool:
    """Whether a new request is turned away: its connection refused, or a 503 (the front, with no replica to take it)."""
    try:
        with completion(served, 1):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 503
    except OSError:
        return True


def read_stream(reply) -> tuple[int, str | None, float]:
    """(completion tokens its usage chunk counts, the finish reason, when it ended)."""
    tokens, reason = 0, None
    for line in reply:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            reason = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), reason)
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return tokens, reason, time.monotonic()


def test_an_orderly_stop_refuses_new_requests_and_lets_the_streams_in_flight_finish(served):
    """Last in this module: it stops the server. What a pod's SIGTERM starts (here `trtglm stop`): the OpenAI API
    behind the front takes no new request at once, and the streams already under way get all their tokens within
    the drain."""
    streams = [completion(served, 450, stream=True) for _ in range(6)]
    for reply in streams:
        assert reply.readline().startswith(b"data: ")  # under way
    stopping = threading.Thread(target=lambda: served.stop())
    started = time.monotonic()
    stopping.start()
    while not turned_away(served):
        assert time.monotonic() - started < 10, "the OpenAI API still takes requests 10 s into the stop"
        time.sleep(0.02)
    refused_at = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        ended = list(pool.map(read_stream, streams))
    stopping.join(DRAIN_S * 3)
    assert [(tokens, reason) for tokens, reason, _ in ended] == [(450, "length")] * 6
    assert refused_at < min(end for _, _, end in ended)  # refused while they were still streaming
    assert not stopping.is_alive()
