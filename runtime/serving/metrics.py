"""A server's Prometheus metrics (`GET /metrics`), named as vLLM's and llama.cpp's servers name theirs, with the
prefix `specrt:`, so that the dashboards and autoscalers written for them read these.

Each server has a registry of its own (not prometheus_client's global one): several servers in one process (tests,
replicas) count apart. Counters and histograms carry the labels `model_name` and `method` (the method a request ran:
`auto` resolved); the gauges `model_name`. The speculative-decoding counters and the token counts are added when a
sequence ends (the figures of its `specrt` stats), so that they equal the sums of the answers' figures.

The prefix cache's figures are read from the cache at each scrape (PrefixCache.stats; label `model_name` only: one
cache serves every method). As vLLM's: `prefix_cache_queries` and `prefix_cache_hits` count prompt tokens (looked up;
served from the cache), so that hits / queries is the share of prompt tokens not prefilled. specrt's own beside them:
`prefix_cache_requests` and `prefix_cache_request_hits` (lookups, and those that found a block),
`prefix_cache_evictions` (blocks), and the gauges `prefix_cache_bytes` and `prefix_cache_max_bytes` (0: no cache).
Suffix decoding's index of finished outputs (--suffix-cache) likewise: the gauges `suffix_cache_outputs`,
`suffix_cache_tokens` and `suffix_cache_bytes` (0: none). These figures tell of every client's requests, so they are
here, behind the API key, and never on the open /health.

The static KV cache's use, read from the scheduler at each scrape (label `model_name`): `kv_cache_usage_perc`, the
share of the batch's rows taken (live or being prefilled: a row's buffers are its request's from admission to its
end, as vLLM's blocks are once allocated, so this is what admission depends on), and `kv_cache_positions_perc`, the
share of the rows' positions that hold tokens.

Under vLLM's own names too (prefix `vllm:`, VLLM_NAMES): the figures vLLM defines, with the same meaning, as well as
under `specrt:`. Gateways and autoscalers read vLLM's names as they are (the Gateway API inference extension's
endpoint picker reads `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, or `vllm:gpu_cache_usage_perc`
in its older releases; KServe's and vLLM's dashboards the rest), so they need no configuration for specrt; the
`specrt:` names stay for the dashboards already written for them and for the figures vLLM has no name for.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "specrt:"
# seconds: time to first token, end-to-end and queue time (vLLM's buckets, cut at 10 min)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# seconds between two hand-outs of tokens to one sequence (a round: one or more tokens)
GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")   # abort: the client left; error: the request failed
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"   # the text format every Prometheus reads
VLLM = "vllm:"
# specrt's name -> vLLM's names for the same figure (the older ones beside, for the readers that still use them)
VLLM_NAMES = {name: (name,) for name in (
    "num_requests_running", "num_requests_waiting", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")} | {
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds")}


class Metrics:
    """The counters, histograms and gauges of one server (model_name: its model id; prefix_cache: the generator's
    PrefixCache now, or None)."""

    def __init__(self, model_name: str, waiting: Callable[[], float],
                 prefix_cache: Callable[[], object] = lambda: None, suffix_cache: Callable[[], object] = lambda: None,
                 kv_cache: Callable[[], tuple] = lambda: (0, 0, 0, 0)):
        """kv_cache: (rows taken, rows, positions holding tokens, positions) of the static cache now."""
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        registry.register(_PrefixCacheFigures(model_name, prefix_cache))
        registry.register(_SuffixCacheFigures(model_name, suffix_cache))
        registry.register(_KvCacheFigures(model_name, kv_cache))
        self.vllm = CollectorRegistry(auto_describe=False)
        self.vllm.register(_VllmNames(registry))
        labels = ["model_name", "method"]

        def counter(name: str, doc: str, extra: tuple = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Rounds that proposed draft tokens, summed over sequences.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed (a tree: its nodes).")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0: the first).", ("position",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Finished sequences by finish reason (a request's choices "
                                                   "each).", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival at the scheduler to its "
                                                             "first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between two hand-outs of tokens to a sequence.",
                             GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From a sequence's arrival at the scheduler to its end.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "From a request's arrival at the scheduler to its "
                                                             "admission into the batch.", LATENCY_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running", "Rows live or being prefilled.", ["model_name"],
                             registry=registry).labels(model_name)
        gauge = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a row.", ["model_name"],
                      registry=registry).labels(model_name)
        gauge.set_function(waiting)

    def admitted(self, method: str, prompt_tokens: int, queued_s: float) -> None:
        self.prompt_tokens.labels(self.model_name, method).inc(prompt_tokens)
        self.queue.labels(self.model_name, method).observe(queued_s)

    def handed(self, method: str, tokens: int, first_s: float | None, gap_s: float | None) -> None:
        """Tokens handed to a sequence: its first (first_s after its arrival), or gap_s after the previous ones."""
        self.generation_tokens.labels(self.model_name, method).inc(tokens)
        if first_s is not None:
            self.ttft.labels(self.model_name, method).observe(first_s)
        if gap_s is not None:
            self.itl.labels(self.model_name, method).observe(gap_s)

    def ended(self, method: str, stats: dict, e2e_s: float) -> None:
        """A sequence ended: its speculative-decoding figures (Batch.row_stats) and its time."""
        labels = (self.model_name, method)
        self.drafts.labels(*labels).inc(stats["drafts"])
        self.draft_tokens.labels(*labels).inc(stats["draft_tokens"])
        self.accepted_tokens.labels(*labels).inc(stats["accepted_tokens"])
        for position, n in enumerate(stats["accepted_per_position"]):
            self.accepted_per_pos.labels(*labels, str(position)).inc(n)
        self.e2e.labels(*labels).observe(e2e_s)

    def finish(self, method: str, reason: str) -> None:
        self.finished.labels(self.model_name, method, reason).inc()

    def exposition(self) -> bytes:
        """The text format of all of them (GET /metrics), under specrt's names and vLLM's."""
        return generate_latest(self.registry) + generate_latest(self.vllm)


class _PrefixCacheFigures:
    """The prefix cache's counters and gauges, read from its stats() at each scrape (see the module doc)."""
    COUNTERS = (("prefix_cache_queries", "query_tokens", "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits", "hit_tokens", "Prompt tokens served from the prefix cache (copied, not "
                                                    "prefilled)."),
                ("prefix_cache_requests", "queries", "Requests looked up in the prefix cache."),
                ("prefix_cache_request_hits", "hits", "Requests that found at least one cached block."),
                ("prefix_cache_evictions", "evictions", "Blocks evicted from the prefix cache (least recently used)."))
    GAUGES = (("prefix_cache_bytes", "bytes", "Bytes the prefix cache holds."),
              ("prefix_cache_max_bytes", "max_bytes", "The prefix cache's bound in bytes (0: no cache)."))

    def __init__(self, model_name: str, cache: Callable[[], object]):
        self.model_name, self.cache = model_name, cache

    def collect(self):
        cache = self.cache()
        stats = cache.stats() if cache is not None else {}
        for kind, table in ((CounterMetricFamily, self.COUNTERS), (GaugeMetricFamily, self.GAUGES)):
            for name, key, doc in table:
                family = kind(PREFIX + name, doc, labels=["model_name"])
                family.add_metric([self.model_name], stats.get(key, 0))
                yield family


class _SuffixCacheFigures:
    """Suffix decoding's index (SuffixCache): its outputs, tokens and bytes, read at each scrape."""
    GAUGES = (("suffix_cache_outputs", "outputs", "Finished outputs in the suffix cache."),
              ("suffix_cache_tokens", "used", "Tokens in the suffix cache."),
              ("suffix_cache_bytes", "nbytes", "Bytes of the suffix cache's index (0: no cache)."))

    def __init__(self, model_name: str, cache: Callable[[], object]):
        self.model_name, self.cache = model_name, cache

    def collect(self):
        cache = self.cache()
        for name, attribute, doc in self.GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], getattr(cache, attribute) if cache is not None else 0)
            yield family


class _KvCacheFigures:
    """The static KV cache's rows and positions in use, as shares (see the module doc)."""

    def __init__(self, model_name: str, kv_cache: Callable[[], tuple]):
        self.model_name, self.kv_cache = model_name, kv_cache

    def collect(self):
        rows_taken, rows, used, positions = self.kv_cache()
        for name, share, doc in (
                ("kv_cache_usage_perc", rows_taken / rows if rows else 0.0,
                 "Share of the static KV cache's rows taken by requests (1: all; a request waits for a row)."),
                ("kv_cache_positions_perc", used / positions if positions else 0.0,
                 "Share of the static KV cache's positions (rows x positions a row) that hold tokens.")):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], share)
            yield family


class _VllmNames:
    """The figures of `registry` that vLLM defines, under vLLM's names (VLLM_NAMES), read at each scrape."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            for name in VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()):
                renamed = Metric(VLLM + name, family.documentation, family.type)
                renamed.samples = [s._replace(name=VLLM + name + s.name[len(family.name):]) for s in family.samples]
                yield renamed


def merge(texts: dict[str, bytes], label: str) -> bytes:
    """Several servers' texts as one: every sample gains `label` = its server's key (a replica's name), and before
    them comes the whole, without `label`, as one server would report it (`whole`)."""
    families: dict[str, Metric] = {}
    for source, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, label: source}) for s in family.samples]
    for family in families.values():
        family.samples = whole(family, label) + family.samples

    class Merged:
        def collect(self):
            return families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


def whole(family: Metric, label: str) -> list:
    """The servers' samples of one family (each labelled `label`) combined by their other labels: counters,
    histograms (buckets, counts, sums) and gauges summed, but shares (names ending `_perc`) averaged: with equal rows
    in every server (replicas of one deployment) the mean is the share of all their rows; timestamps (`_created`)
    have no whole."""
    if family.type not in ("counter", "histogram", "gauge") or family.name.endswith("_created"):
        return []
    groups: dict[tuple, list] = {}
    for s in family.samples:
        if not s.name.endswith("_created"):
            key = (s.name, tuple((k, v) for k, v in s.labels.items() if k != label))
            groups.setdefault(key, []).append(s)
    mean = family.name.endswith("_perc")
    return [same[0]._replace(labels=dict(labels), value=sum(s.value for s in same) / (len(same) if mean else 1))
            for (_, labels), same in groups.items()]
