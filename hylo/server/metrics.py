"""Server metrics in the Prometheus text format (version 0.0.4), without a client library: a handful of counters,
gauges and two histograms. The engine thread writes them; ``/metrics`` reads them (plain numbers: the GIL keeps
each read whole)."""

from __future__ import annotations

from collections import Counter

from ..core import Req

PREFIX = "hylo"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return out


class Metrics:
    def __init__(self):
        self.running = self.waiting = 0
        self.req_slots_used = self.req_slots_total = 0
        self.kv_used = self.kv_total = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.requests_started = 0
        self.rejected = 0  # refused by the engine's validation (e.g. a prompt over the context limit)
        self.finish_reasons: Counter = Counter()
        self.spec_verify_steps = 0
        self.spec_emitted_tokens = 0
        self.spec_plain_steps = 0
        self.prefix = None  # the engine's prefix cache (cache.prefix_cache.PrefixCache), read at render time
        self.automata = None  # the engine's compiled constraints (constrain.automaton.AutomatonCache), the same
        self.engine = None  # the engine, for its counters (host_syncs), the same
        self.prefix_slot_bytes = self.prefix_kv_token_bytes = 0
        self.ttft = Histogram((0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.token_latency = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

    def finished(self, req: Req) -> None:
        self.finish_reasons[req.finish_reason or "unknown"] += 1
        self.prompt_tokens += len(req.prompt_ids)
        if req.spec is not None:
            self.spec_verify_steps += req.spec.verify_steps
            self.spec_emitted_tokens += req.spec.emitted_tokens
            self.spec_plain_steps += req.spec.plain_steps

    def render(self) -> str:
        p = PREFIX
        lines: list[str] = []

        def metric(name, kind, help_text, value, labels=""):
            lines.extend([f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} {kind}", f"{p}_{name}{labels} {value}"])

        metric("requests_running", "gauge", "Requests holding a slot in the engine.", self.running)
        metric("requests_waiting", "gauge", "Requests queued for admission.", self.waiting)
        metric("request_slots_used", "gauge", "Request slots in use.", self.req_slots_used)
        metric("request_slots_total", "gauge", "Request slots (max_num_seqs).", self.req_slots_total)
        metric("kv_cache_tokens_used", "gauge", "KV cache positions reserved by requests.", self.kv_used)
        metric("kv_cache_tokens_total", "gauge", "KV cache positions in the pool.", self.kv_total)
        metric("kv_cache_usage_ratio", "gauge", "Fraction of the KV pool in use.",
               f"{self.kv_used / self.kv_total if self.kv_total else 0.0:.6f}")
        metric("generation_tokens_total", "counter", "Tokens generated.", self.generated_tokens)
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("requests_started_total", "counter", "Requests admitted to the engine.", self.requests_started)
        metric("requests_rejected_total", "counter", "Requests the engine refused as invalid.", self.rejected)
        lines += [f"# HELP {p}_requests_finished_total Finished requests by reason.",
                  f"# TYPE {p}_requests_finished_total counter"]
        for reason in sorted(set(self.finish_reasons) | {"stop", "length", "abort"}):
            lines.append(f'{p}_requests_finished_total{{reason="{reason}"}} {self.finish_reasons[reason]}')
        metric("spec_verify_steps_total", "counter", "Speculative verify steps of finished requests.",
               self.spec_verify_steps)
        metric("spec_emitted_tokens_total", "counter", "Tokens emitted by speculative verify steps.",
               self.spec_emitted_tokens)
        metric("spec_plain_steps_total", "counter", "Steps of finished requests that decoded without drafts (the "
               "adaptive speculation policy's fallback).", self.spec_plain_steps)
        accept = self.spec_emitted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0
        metric("spec_accept_length", "gauge", "Mean tokens emitted per verify step (bonus token included).",
               f"{accept:.6f}")
        pc = self.prefix
        if pc is not None:
            st = pc.stats
            metric("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
                   st.queried_tokens)
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
                   st.hit_tokens)
            metric("prefix_cache_snapshots", "gauge", "Linear-attention state snapshots the prefix cache holds.",
                   pc.num_snapshots)
            metric("prefix_cache_kv_tokens", "gauge", "KV positions the prefix cache holds.", pc.kv_tokens)
            metric("prefix_cache_bytes", "gauge", "Device bytes the prefix cache holds (snapshots and KV).",
                   pc.num_snapshots * self.prefix_slot_bytes + pc.kv_tokens * self.prefix_kv_token_bytes)
            metric("prefix_cache_evicted_tokens_total", "counter", "KV positions evicted from the prefix cache.",
                   st.kv_evicted)
            metric("prefix_cache_evicted_snapshots_total", "counter", "State snapshots evicted from the prefix cache.",
                   st.snapshots_evicted)
        if self.automata is not None:
            metric("constraint_compiles_total", "counter", "Output constraints compiled to token automata (each "
                   "distinct constraint once while cached).", self.automata.compiles)
            metric("constraint_compile_seconds_total", "counter", "Seconds spent compiling output constraints.",
                   round(self.automata.compile_seconds, 6))
        if self.engine is not None:
            metric("constraint_host_syncs_total", "counter", "Blocking reads of a step's tokens before the next "
                   "launch, for grammar constraints matched on the host.", getattr(self.engine, "host_syncs", 0))
        lines += self.ttft.lines(f"{p}_time_to_first_token_seconds", "Time from arrival to the first token.")
        lines += self.token_latency.lines(f"{p}_time_per_output_token_seconds",
                                          "Time between output tokens of one request.")
        return "\n".join(lines) + "\n"
