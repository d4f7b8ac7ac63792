"""The API's /metrics page (trtglm/openai_api/metrics.py): its own families and Triton's in one Prometheus text, each
family once, read as Prometheus reads it (prometheus_client's parser); its own alone when Triton's do not answer.
Triton's text here is written as tritonserver writes it (counters without `_total`); tests/deploy reads a real one."""

from __future__ import annotations

import http.server
import threading

import pytest

from trtglm.openai_api.admission import Admission
from trtglm.openai_api.metrics import MetricsPage, families, merged, own_metrics

TRITON = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 3
nv_inference_request_success{model="tensorrt_llm",version="1"} 3
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 8
# HELP trtglm_openai_sequences a family of the API's name, which the API's own page keeps
# TYPE trtglm_openai_sequences gauge
trtglm_openai_sequences{state="waiting"} 99
# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0.25
"""


def parsed(text: str) -> dict[str, dict[tuple, float]]:
    """family → {(sample name, labels): value}, as Prometheus reads the page; a family named twice fails."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in found, f"{family.name} twice"
        found[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return found


def busy_admission() -> Admission:
    admission = Admission(slots=8, largest_request=16)
    admission.admit(12)
    admission.grant()  # nothing asked for a place yet: 12 waiting
    return admission


def test_one_page_holds_the_apis_families_and_tritons_each_once():
    page = parsed(merged(own_metrics(busy_admission()), TRITON))
    assert {"nv_inference_request_success", "nv_trt_llm_request_metrics", "nv_cpu_utilization"} <= set(page)
    assert {"trtglm_openai_sequences", "trtglm_openai_waiting_limit", "trtglm_openai_refused_requests"} <= set(page)
    assert page["trtglm_openai_sequences"][("trtglm_openai_sequences", (("state", "waiting"),))] == 12  # the API's
    assert page["nv_trt_llm_request_metrics"] == {
        ("nv_trt_llm_request_metrics", (("model", "tensorrt_llm"), ("request_type", "waiting"), ("version", "1"))): 2,
        ("nv_trt_llm_request_metrics", (("model", "tensorrt_llm"), ("request_type", "scheduled"), ("version", "1"))): 8}
    assert len(page["nv_inference_request_success"]) == 2


def test_a_family_holds_its_samples_and_a_histograms_series():
    text = ("# HELP h a histogram\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3\n"
            "h_count 2\nlone_sample 7\n")
    assert {name: len(lines) for name, lines in families(text).items()} == {"h": 6, "lone_sample": 1}


class TritonMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = TRITON.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def triton_metrics():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TritonMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_tritons_metrics_are_read_at_each_scrape_and_the_apis_own_stay_when_they_do_not_answer(triton_metrics, caplog):
    server, url = triton_metrics
    page = MetricsPage(busy_admission(), url)
    assert "nv_trt_llm_request_metrics" in parsed(page.text())
    server.shutdown()
    server.server_close()
    for _ in range(2):
        alone = parsed(page.text())
        assert "nv_trt_llm_request_metrics" not in alone and "trtglm_openai_sequences" in alone
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1  # said once
    assert set(parsed(MetricsPage(busy_admission(), None).text())) == set(alone)
