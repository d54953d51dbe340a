"""The fake LLM backend's ``GET /metrics``: its engine's state under vLLM's metric names.

So that whatever reads a vLLM fleet's metrics (a load- or cache-aware router, a dashboard)
can read a fake one. The names, types, help texts and the ``model_name`` label are vLLM v1's
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; vLLM also labels ``engine``, which
one fake engine has no use for):

==================================  =======  ==============================================
``vllm:num_requests_running``       gauge    generations running
``vllm:num_requests_waiting``       gauge    generations waiting for a slot
``vllm:kv_cache_usage_perc``        gauge    KV blocks pinned by running requests, 0..1
``vllm:prefix_cache_queries_total`` counter  prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``    counter  of those, tokens found cached
==================================  =======  ==============================================

Written with prometheus_client's public API, as vLLM does: one private ``CollectorRegistry``
per engine (never the process-wide default, so two fakes in one process keep their own
counts), its ``Gauge`` and ``Counter`` metrics, and ``generate_latest`` for the text format
0.0.4. prometheus_client appends ``_total`` to a counter's name, as it does for vLLM's, and
adds a ``_created`` series per counter.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from muxproxy.testing.fakellm.lora import LoraSlots
from muxproxy.trio.metrics import CONTENT_TYPE

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

_LABELS = ("model_name",)


class EngineMetrics:
    """The vLLM-named metrics of one fake engine, in a registry of their own."""

    def __init__(self, model_name: str, *, lora: bool = False) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name,)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, _LABELS, registry=self.registry).labels(*labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, _LABELS, registry=self.registry).labels(*labels)

        self._running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self._waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self._kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self._queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self._hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._lora_info: Gauge | None = None
        self._lora_at = 0.0
        if lora:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                registry=self.registry,
            )

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prefix cache lookup: ``queried_tokens`` looked up, ``hit_tokens`` found."""
        self._queries.inc(queried_tokens)
        self._hits.inc(hit_tokens)

    def render(
        self, *, running: int, waiting: int, kv_usage: float, lora: LoraSlots | None = None
    ) -> bytes:
        """The text exposition, with the gauges set to the values given (and the adapters
        of ``lora``, with LoRA)."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_usage.set(kv_usage)
        if self._lora_info is not None and lora is not None:
            self._lora_at = max(time.time(), self._lora_at + 0.001)
            self._lora_info.labels(*lora.labels()).set(self._lora_at)
        return generate_latest(self.registry)
