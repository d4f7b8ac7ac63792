"""The executor's counters as Triton custom metrics (Triton's /metrics), on rank 0, refreshed twice a second.

Two sets, from the same `ExecutorStats`:

- trtglm's own: `trtglm_active_sequences`, `trtglm_queued_requests`, `trtglm_max_decode_batch` and the counters
  of steps, tokens and step time (`TRTGLM_GAUGES`, `TRTGLM_COUNTERS`);
- NVIDIA's, as TensorRT-LLM's `tensorrt_llm` model exports them (tensorrtllm_backend's inflight_batcher_llm):
  the gauge families `nv_trt_llm_request_metrics{request_type=...}` and
  `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=...}`, labelled with the model's name and version.
  They are the names that the Gateway API Inference Extension's endpoint picker reads for its
  `triton-tensorrt-llm` engine type: queued requests (`waiting`), running requests (`scheduled`), KV-cache use
  (`fraction`), its block size (`tokens_per`) and block count (`max`), and what autoscaling reads
  (deploy/kubernetes/). The values mean what NVIDIA's mean: `active` is every request the executor holds
  (`scheduled` + `waiting`), `max` the most it runs at once, `context` those still computing their prompt; the
  KV cache's `used` blocks are held by running requests (each from its admission, for its whole length, as
  TensorRT-LLM's guaranteed_no_evict policy reserves them), `fraction` is used / max.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from trtglm.runtime.request import ExecutorStats

log = logging.getLogger(__name__)

PERIOD_S = 0.5
TRTGLM_GAUGES = {"trtglm_active_sequences": ("active", "requests being generated now"),
                 "trtglm_queued_requests": ("queued", "requests waiting for a slot"),
                 "trtglm_max_decode_batch": ("max_decode_batch", "the most requests decoded together in one step")}
TRTGLM_COUNTERS = {"trtglm_decode_steps_total": ("decode_calls", "decode steps run"),
                   "trtglm_generated_tokens_total": ("generated_tokens", "tokens generated"),
                   "trtglm_prompt_tokens_total": ("prefill_tokens", "prompt tokens computed"),
                   "trtglm_reused_prompt_tokens_total": ("reused_tokens", "prompt tokens taken from the prefix cache"),
                   "trtglm_step_microseconds_total": ("step_us", "time the engine spent in steps"),
                   "trtglm_decode_only_steps_total": ("decode_only_steps", "steps of decode tokens alone"),
                   "trtglm_decode_only_step_microseconds_total": ("decode_only_us", "time of the steps of decode "
                                                                                    "tokens alone")}


def _fraction(stats: ExecutorStats) -> float:
    return stats.kv_blocks_used / stats.kv_blocks if stats.kv_blocks else 0.0


# family -> (its description, its label, label value -> the value from the stats); descriptions are NVIDIA's
NVIDIA_FAMILIES: dict[str, tuple[str, str, dict[str, Callable[[ExecutorStats], float]]]] = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type", {
        "waiting": lambda s: s.queued,
        "scheduled": lambda s: s.active,
        "context": lambda s: s.prefilling,
        "active": lambda s: s.queued + s.active,
        "max": lambda s: s.slots}),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type", {
        "max": lambda s: s.kv_blocks,
        "used": lambda s: s.kv_blocks_used,
        "free": lambda s: s.kv_blocks - s.kv_blocks_used,
        "tokens_per": lambda s: s.tokens_per_block,
        "fraction": _fraction}),
}


class Metrics:
    """Both sets of metrics for `model` (its `version`), read from `stats` (the executor's) by a thread of their own."""

    def __init__(self, stats: Callable[[], ExecutorStats], pb_utils, model: str, version: str):
        self.stats = stats
        family = pb_utils.MetricFamily
        self.families = []  # a metric works only while its family lives
        self.gauges: list[tuple[object, Callable[[ExecutorStats], float]]] = []
        self.counters: list[tuple[object, str]] = []  # (metric, ExecutorStats field)
        for table, kind in ((TRTGLM_GAUGES, family.GAUGE), (TRTGLM_COUNTERS, family.COUNTER)):
            for name, (field, description) in table.items():
                self.families.append(family(name=name, description=description, kind=kind))
                if kind == family.COUNTER:
                    self.counters.append((self.families[-1].Metric(labels={}), field))
                else:
                    self.gauges.append((self.families[-1].Metric(labels={}), lambda s, field=field: getattr(s, field)))
        for name, (description, label, values) in NVIDIA_FAMILIES.items():
            self.families.append(family(name=name, description=description, kind=family.GAUGE))
            for value, read in values.items():
                labels = {label: value, "model": model, "version": version}
                self.gauges.append((self.families[-1].Metric(labels=labels), read))
        self.counted: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trtglm-metrics", daemon=True)
        self.refresh()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.refresh()
            except Exception as e:  # metrics must never take the model down
                log.warning("metrics: %s", e)

    def refresh(self) -> None:
        stats = self.stats()
        for metric, read in self.gauges:
            metric.set(float(read(stats)))
        for metric, field in self.counters:
            value = int(getattr(stats, field))
            delta = value - self.counted.get(field, 0)
            if delta:
                metric.increment(delta)
                self.counted[field] = value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.gauges.clear()  # metrics before their families
        self.counters.clear()
        self.families.clear()
