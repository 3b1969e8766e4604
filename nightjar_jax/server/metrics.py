"""Prometheus metrics for one server (its own ``CollectorRegistry``, so several apps can live in one process).

Latency histograms and the per-finish-reason counter are fed by the engine thread as outputs finish
(``ServerMetrics.on_output``); the gauges and engine counters (pages, queue lengths, γ, decode steps per γ, a tree's
nodes, drafted / accepted tokens overall, per draft position and from n-gram lookup, planner switches, prefix cache
queries and hits) are read from the engine at scrape time by :class:`_EngineCollector`, never in the middle of a draft
offload or reload (under ``LLMEngine.state_lock``).

The same figures are also exported under vLLM's names (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ``vllm:spec_decode_num_accepted_tokens_total``, ..., each labelled
``model_name``), so dashboards and autoscalers built for vLLM read this server as they read vLLM; with vLLM's
per-request histograms too: prompt and generated tokens (``vllm:request_prompt_tokens``, 1-2-5 buckets up to the
context) and the queue, prefill, decode and inference phases (``vllm:request_queue_time_seconds``, ...).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nightjar_jax.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit`` (the context length), ``limit`` last."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= limit:
                return (*out, limit)
            out.append(step * scale)
        scale *= 10


class _EngineCollector:
    """Reads engine gauges and counters when ``/metrics`` is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        # (never in the middle of a draft move, which would show its half-made state)
        with self.engine.state_lock:
            families = [*self._nightjar(), *self._vllm()]
        yield from families

    def _vllm(self):
        """vLLM's v1 names for what ``_nightjar`` reports (its counters end in ``_total``)."""
        e, stats, labels = self.engine, self.engine.stats, (["model_name"], [self.model_name])

        def family(kind, name: str, doc: str, value: float):
            metric = kind(name, doc, labels=labels[0])
            metric.add_metric(labels[1], value)
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch",
                     len(e.scheduler.running))
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled",
                     len(e.scheduler.waiting))
        total = e.num_total_pages
        # (the share of pages requests hold: 0 while the KV cache sleeps, which nothing runs on, where the
        # nightjar_ gauge counts no page free)
        used = 0 if "kv_cache" in e.asleep_parts else total - e.num_free_pages
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (1: every page used)",
                     used / total if total else 0.0)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Requests preempted for KV space",
                     stats.num_preemptions)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens accepted", stats.num_prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Tokens generated", stats.num_generated_tokens)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                     stats.num_prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Of those, the tokens found cached",
                     stats.num_prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Sequence-steps that drafted",
                     stats.drafted_per_position[0] if stats.drafted_per_position else 0)
        yield family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                     stats.num_drafted_tokens)
        yield family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                     stats.num_accepted_tokens)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens "
                                           "per position (0-based)", labels=["model_name", "position"])
        for i, accepted in enumerate(stats.accepted_per_position):
            per_position.add_metric([self.model_name, str(i)], accepted)
        yield per_position

    def _nightjar(self):
        e = self.engine
        stats = e.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("nightjar_num_requests_running", "Requests in the running batch", len(e.scheduler.running))
        yield gauge("nightjar_num_requests_waiting", "Requests waiting to be scheduled", len(e.scheduler.waiting))
        # (a gauge: the extension pool comes and goes; "_total" would read as a counter, reset at every reload)
        yield gauge("nightjar_kv_pages_usable", "Usable KV cache pages (the base pool's, plus an extension pool's "
                    "while the draft is offloaded)", e.num_total_pages)
        yield gauge("nightjar_kv_pages_free", "Free KV cache pages (0 while the KV cache sleeps: it holds none)",
                    e.num_free_pages)
        yield gauge("nightjar_spec_gamma", "Speculation length γ of the latest decode step", stats.last_gamma)
        yield gauge("nightjar_spec_tree_nodes", "Drafted nodes per sequence of the latest decode step if it verified "
                    "a token tree (the draft's and, with lookup on, the copy branch's), else 0", stats.last_tree_nodes)
        steps = CounterMetricFamily("nightjar_decode_steps", "Decode steps by the speculation length γ they ran "
                                    "(γ = 0: plain decoding; the planner's choices, and γ_max where every request "
                                    "copied n-gram lookup drafts in full)", labels=["gamma"])
        for g in range(e.gamma_max + 1):
            steps.add_metric([str(g)], stats.decode_steps_per_gamma.get(g, 0))
        yield steps
        yield counter("nightjar_decode_steps_compiling", "Decode steps that compiled (or loaded) a step variant: "
                      "first uses no warm-up covered (--warmup full compiles the decode variants before traffic)",
                      stats.num_compiling_decode_steps)
        yield counter("nightjar_compile_evictions", "Times the least used compiled step variants were dropped "
                      "because the process ran short of memory maps (CPU backend: vm.max_map_count)",
                      stats.num_compile_evictions)
        yield counter("nightjar_spec_draft_tokens", "Draft tokens proposed", stats.num_drafted_tokens)
        yield counter("nightjar_spec_accepted_tokens", "Draft tokens accepted by the target", stats.num_accepted_tokens)
        drafted = CounterMetricFamily(
            "nightjar_spec_drafted_per_position", "Sequence-steps that drafted this position (1-based: γ >= it)",
            labels=["position"])
        accepted = CounterMetricFamily(
            "nightjar_spec_accepted_per_position", "Sequence-steps whose draft was accepted at least up to this "
            "position (1-based); a tree counts its accepted branch's depth", labels=["position"])
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position, strict=True)):
            drafted.add_metric([str(i + 1)], d)
            accepted.add_metric([str(i + 1)], a)
        yield drafted
        yield accepted
        yield counter("nightjar_spec_lookup_steps", "Sequence-steps whose drafts were copied by n-gram lookup "
                      "(--prompt-lookup-max) instead of the draft's (tree steps: whose copy branch held a match)",
                      stats.num_lookup_steps)
        yield counter("nightjar_spec_lookup_accepted_tokens", "Draft tokens accepted in those sequence-steps",
                      stats.num_lookup_accepted)
        yield gauge("nightjar_draft_offloaded", "1 while the draft model is offloaded to host memory (--draft-offload "
                    "auto)", int(e.draft_offloaded))
        yield gauge("nightjar_kv_extension_pages", "KV pages of the extension pool the offloaded draft's bytes hold",
                    e.allocator.num_extension)
        yield gauge("nightjar_engine_sleep_level", "0 while the engine is awake, else the level of its sleep (serve "
                    "--enable-sleep-mode: POST /sleep)", e.sleep_level if e.is_sleeping else 0)
        yield counter("nightjar_draft_offloads", "Draft model offloads", stats.num_draft_offloads)
        yield counter("nightjar_draft_reloads", "Draft model reloads", stats.num_draft_reloads)
        yield counter(
            "nightjar_planner_switches", "Changes of γ chosen by the planner", e.planner_switches
        )
        yield counter("nightjar_preemptions", "Requests preempted for KV space", stats.num_preemptions)
        yield counter("nightjar_prefix_cache_queries", "Prompt tokens of the requests admitted with a prefix cache "
                      "lookup (--enable-prefix-caching; a recompute after a preemption looks up again)",
                      stats.num_prefix_cache_queries)
        yield counter("nightjar_prefix_cache_hits", "Of those, the tokens whose K/V were found cached",
                      stats.num_prefix_cache_hits)
        yield counter("nightjar_prefix_cache_draft_hits", "Of the hits, the tokens whose draft K/V were found cached "
                      "too (the draft skips its catch-up over them)", stats.num_prefix_cache_draft_hits)
        yield gauge("nightjar_kv_pages_cached", "Free KV pages still holding a cached prefix (counted free: handed "
                    "out after the others)", e.allocator.num_cached_free)
        yield counter("nightjar_prompt_tokens", "Prompt tokens accepted", stats.num_prompt_tokens)
        yield counter("nightjar_generation_tokens", "Tokens generated", stats.num_generated_tokens)


class _ServerCollector:
    """The HTTP front's own figures, which the engine does not see (read from one-element lists the app keeps)."""

    def __init__(self, load: list[int], updates_waiting: list[int], beam_searches: list[int]):
        self.load, self.updates_waiting, self.beam_searches = load, updates_waiting, beam_searches

    def collect(self):
        yield GaugeMetricFamily("nightjar_server_load", "Generation requests the server holds, from their arrival to "
                                "their last frame (GET /load's figure)", value=self.load[0])
        yield GaugeMetricFamily("nightjar_weight_updates_waiting", "Weight updates (POST /update_weights_from_disk) "
                                "waiting for the requests in flight to finish", value=self.updates_waiting[0])
        yield GaugeMetricFamily("nightjar_beam_searches", "Beam searches under way (each runs many engine steps, "
                                "the engine idle between them)", value=self.beam_searches[0])


class ServerMetrics:
    def __init__(self, engine, model_name: str | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self._server: _ServerCollector | None = None  # (track_server)
        self.model_name = model_name or engine.config.model
        # vLLM's names (module docstring), fed alongside
        name = ["model_name"]
        self.vllm_requests = Counter("vllm:request_success", "Finished requests by finish reason",
                                     ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.vllm_requests.labels(self.model_name, reason)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", name,
                                   buckets=_LATENCY_BUCKETS, registry=r).labels(self.model_name)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the "
                                   "first", name, buckets=_LATENCY_BUCKETS, registry=r).labels(self.model_name)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens", name,
                                  buckets=_LATENCY_BUCKETS, registry=r).labels(self.model_name)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", name,
                                  buckets=_E2E_BUCKETS, registry=r).labels(self.model_name)
        # vLLM's per-request phases (its Grafana dashboard's queue / prefill / decode panels) and token counts
        phases = {"queue": "Arrival to first scheduled (waiting in the queue)",
                  "prefill": "First scheduled to first token", "decode": "First token to the last",
                  "inference": "First scheduled to finish (running, preempted spells included)"}
        self.vllm_phases = {phase: Histogram(f"vllm:request_{phase}_time_seconds", doc, name, buckets=_E2E_BUCKETS,
                                             registry=r).labels(self.model_name) for phase, doc in phases.items()}
        tokens = one_two_five_buckets(engine.max_sequence_len)
        self.vllm_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", name,
                                            buckets=tokens, registry=r).labels(self.model_name)
        self.vllm_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per request",
                                                name, buckets=tokens, registry=r).labels(self.model_name)
        self.requests = Counter(
            "nightjar_requests", "Finished engine requests by finish reason", ["finish_reason"], registry=r
        )
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        self.ttft = Histogram(
            "nightjar_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "nightjar_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "nightjar_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "nightjar_e2e_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS, registry=r
        )
        r.register(_EngineCollector(engine, self.model_name))

    def track_server(self, load: list[int], updates_waiting: list[int], beam_searches: list[int]) -> None:
        """Export the server's own load, waiting weight updates and beam searches (registered once: an app built
        again over these metrics reads its own lists)."""
        if self._server is None:
            self._server = _ServerCollector(load, updates_waiting, beam_searches)
            self.registry.register(self._server)
        else:
            self._server.load, self._server.updates_waiting, self._server.beam_searches = (
                load, updates_waiting, beam_searches)

    def on_output(self, out: RequestOutput) -> None:
        """Record a finished request's latencies (runs on the engine thread; a shutdown's answers, from the thread
        that stops it: prometheus_client's metrics take both)."""
        if not out.finished:
            return
        reason = out.outputs[0].finish_reason or "error"
        self.requests.labels(reason).inc()
        self.vllm_requests.labels(self.model_name, reason).inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
            self.vllm_ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
            self.vllm_tpot.observe(m.tpot)
        for itl in m.itls():
            self.itl.observe(itl)
            if itl > 0:  # (vLLM's: one sample per step; the tokens one speculative step commits share its time)
                self.vllm_itl.observe(itl)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
            self.vllm_e2e.observe(m.e2e)
        self.vllm_prompt_tokens.observe(len(out.prompt_token_ids))
        self.vllm_generation_tokens.observe(len(out.outputs[0].token_ids))
        scheduled, first, end = m.first_scheduled_time, m.first_token_time, m.finish_time
        spans = {"queue": (m.arrival_time, scheduled), "prefill": (scheduled, first),
                 "decode": (first, m.token_times[-1] if m.token_times else None), "inference": (scheduled, end)}
        for phase, (start, stop) in spans.items():  # (a request aborted before a phase began has none)
            if start is not None and stop is not None:
                self.vllm_phases[phase].observe(max(0.0, stop - start))

    def render(self) -> bytes:
        return generate_latest(self.registry)
