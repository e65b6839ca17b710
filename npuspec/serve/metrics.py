"""Prometheus metrics of `npuspec serve`, named as vLLM names its own with the `npuspec:`
prefix (`vllm:time_to_first_token_seconds` -> `npuspec:time_to_first_token_seconds`), so a
vLLM dashboard ports by renaming the prefix.

The event loop updates them from every engine step's message (`on_step`); each server has
its own registry.
"""
from __future__ import annotations

from typing import Optional

from npuspec.cli_util.errors import MissingExtra

# vLLM's buckets for request latencies (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str, k_max: int, num_blocks: int):
        try:  # the [serve] extra
            import prometheus_client as pc
        except ImportError:
            raise MissingExtra("prometheus_client", "serve", "npuspec serve") from None
        self._pc = pc
        pc.disable_created_metrics()  # as vLLM does: no *_created series beside each metric
        self.registry = reg = pc.CollectorRegistry()
        lab = ["model_name"]

        def counter(name, doc, extra=()):
            return pc.Counter(f"npuspec:{name}", doc, lab + list(extra), registry=reg)

        def gauge(name, doc):
            return pc.Gauge(f"npuspec:{name}", doc, lab, registry=reg).labels(model_name)

        def hist(name, doc, buckets):
            return pc.Histogram(f"npuspec:{name}", doc, lab, buckets=buckets,
                                registry=reg).labels(model_name)
        m = model_name
        self.running = gauge("num_requests_running", "Requests prefilling or decoding.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a seat or KV blocks.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(m)
        self._success = counter("request_success", "Finished requests by finish reason.",
                                ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed) for "
                                   "lack of KV blocks.").labels(m)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between a request's successive "
                        "outputs (one per verify step, which may carry several tokens).",
                        ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.num_drafts = counter("spec_decode_num_drafts", "Request-steps that verified at "
                                  "least one draft token.").labels(m)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens "
                                    "verified.").labels(m)
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens "
                                       "accepted.").labels(m)
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                          "at each draft position (0-based).", ["position"])
        self.accepted_per_pos = [per_pos.labels(m, str(i)) for i in range(k_max)]
        self.mean_al = gauge("spec_decode_mean_acceptance_length", "Tokens emitted per "
                             "request-step (1 + accepted / drafts) since start.")
        self.spec_k = gauge("spec_decode_k", "K (draft tokens per request) of the latest "
                            "verify step: the online K controller's choice, or the fixed K.")
        self._steps_by_k = counter("spec_decode_num_steps_by_k", "Verify steps run with each "
                                   "K.", ["k"])
        self._k_seen: dict[int, int] = {}
        self._model, self._num_blocks = m, num_blocks
        # request id -> (arrival, last output time or None, drafted, accepted, by position)
        self._seen: dict[str, tuple[float, Optional[float], int, int, tuple]] = {}
        self._steps = self._accepted = self._preempted = 0

    def finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()

    def on_add(self, req_id: str, num_prompt_tokens: int, arrival: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._seen[req_id] = (arrival, None, 0, 0, ())

    def on_step(self, outs, gauges, aborted, now: float) -> None:
        """Charge one engine step (npuspec.serve.core's Outs, Gauges and aborted requests),
        timed where the client is: on the HTTP side, from each request's arrival."""
        for o in outs:
            seen = self._seen.get(o.req_id)
            if seen is None:
                continue
            arrival, last, d_prev, a_prev, pos_prev = seen
            if o.token_ids:
                self.generation_tokens.inc(len(o.token_ids))
                (self.ttft if last is None else self.itl).observe(now - (last or arrival))
                last = now
            if o.num_drafted > d_prev:
                self.num_drafts.inc()
                self.draft_tokens.inc(o.num_drafted - d_prev)
            for i, a in enumerate(o.accepted_by_position[:len(self.accepted_per_pos)]):
                prev = pos_prev[i] if i < len(pos_prev) else 0
                if a > prev:
                    self.accepted_per_pos[i].inc(a - prev)
            self._steps += 1
            if o.num_accepted > a_prev:
                self._accepted += o.num_accepted - a_prev
                self.accepted_tokens.inc(o.num_accepted - a_prev)
            if o.finish_reason is not None:
                del self._seen[o.req_id]
                self.e2e.observe(now - arrival)
                self.finished(o.finish_reason)
            else:
                self._seen[o.req_id] = (arrival, last, o.num_drafted, o.num_accepted,
                                        o.accepted_by_position)
        for rid, reason in aborted:
            self._seen.pop(rid, None)
            self.finished(reason)
        if self._steps:
            self.mean_al.set(1 + self._accepted / self._steps)
        self.running.set(gauges.running)
        self.waiting.set(gauges.waiting)
        usable = max(self._num_blocks - 1, 1)  # block 0 is scratch
        self.kv_usage.set(1 - gauges.free_blocks / usable)
        for k, n in gauges.steps_by_k:
            if n > self._k_seen.get(k, 0):
                self._steps_by_k.labels(self._model, str(k)).inc(n - self._k_seen.get(k, 0))
                self._k_seen[k] = n
        if gauges.last_k >= 0:
            self.spec_k.set(gauges.last_k)
        if gauges.preemptions > self._preempted:
            self.preemptions.inc(gauges.preemptions - self._preempted)
            self._preempted = gauges.preemptions

    def exposition(self) -> tuple[bytes, str]:
        return self._pc.generate_latest(self.registry), self._pc.CONTENT_TYPE_LATEST

