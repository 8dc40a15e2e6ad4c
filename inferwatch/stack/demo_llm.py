"""``inferwatch demo --scenario llm``: an LLM incident on a stack started with ``up --llm``.

Steady token streams through both sidecars: Triton's streaming model ``tiny_stream`` (v1
stable, v2 canary) through the stack's sidecar (``triton-generate``), and the real vLLM's
two served names (``tiny-llm`` and its canary name) through the LLM sidecar (``openai``).
Then three rounds, one fault each (a model's critical inhibits its warnings and infos, so
played together the lesser pages would never be sent):

1. batch requests fill vLLM's KV cache (LLMKVCacheSaturation: info), stopped and resolved;
2. v2 of tiny_stream sends its first token seconds late (Triton's fault knob;
   InferenceHighTTFT: warning), cleared and resolved;
3. every tiny_stream v1 stream ends with an error after a few tokens (the error-rate tier
   counts a stream's error event as a server_error: critical), cleared and resolved.

The KV-cache round. The stack starts vLLM with a small cache (``config.LLM_KV_CACHE_BLOCKS``
blocks; the CPU build's blocks hold 128 tokens) and priority scheduling. The round reads the
cache's size from vLLM's cache-config metric and sends, through the LLM sidecar, closed-loop
batch requests that each fill whole blocks: a prompt of three blocks and a token (token ids,
so its length is exact) and up to a block of output with ``ignore_eos``, never past the
fourth block, so none grows into a block it cannot get (no preemption). As many as the cache
holds run, and ``BATCH_QUEUE`` more wait in vLLM's queue, so a finished request is replaced
at the engine's next step and a stalled sender does not drain the cache. Usage then sits
near 96%, above the rule's 90%, and dips by one request's blocks (5%) in the engine step
after one finishes. Two finishing in one step take it under 90% for that step (a long one:
the replacements' prefill), which resets the rule's ``for``: the page then comes a ``for``
later, or after the demo's deadline (inferwatch/stack/README.md has the measurements).

What keeps the round from paging on tiny-llm's TTFT instead (its critical budget burn would
inhibit the info page): the batch requests are not streamed, so the sidecar records no first
token for them (a batch answer has none), and they ask for priority 1, so vLLM admits the
interactive streams (priority 0) before them; the blocks a 4-block request cannot use stay
free for those 1-block streams. The interactive streams' TTFT is what the SLO judges, and it
stays where the steady phase had it. A cache left in whole GiB (``up --llm --kv-cache-gib``)
holds too much to fill: the round is then reported as skipped, with the reason.

The pages and the final table are the main demo's (``demo.py``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from alert_rules.config import KV_CACHE_THRESHOLD
from inferwatch import contract
from inferwatch.stack.core import StackInfo
from inferwatch.stack.demo import Demo, Fault, clear_faults, set_fault
from inferwatch.stack.timing import resolve_bound, theoretical_minimum
from reference_server.stream_load import StreamLoadGenerator

STREAM_MODEL = "tiny_stream"
# The main sidecar's streams: (version, weight); the LLM sidecar's: (served name, weight).
STREAM_MIX = (("1", 1.0), ("2", 1.0))
VLLM_MIX = (("tiny-llm", 1.0), ("tiny-llm-canary", 1.0))
WARMUP_STREAMS = 4
KV_MODEL = VLLM_MIX[0][0]  # vLLM's first served name: the model its own metrics are labelled with

# The KV-cache round's batch requests (module docstring): vLLM runs lower values first; the
# interactive streams keep the default, 0.
BATCH_PRIORITY = 1
BATCH_QUEUE = 12  # batch requests waiting in vLLM beyond those its cache holds
BATCH_RAMP_S = 0.1  # between the starts of two batch senders
BATCH_BLOCKS = 4  # cache blocks each batch request fills (a 512-token context, 128-token blocks)
MAX_BATCH_RUNNING = 64  # a cache holding more batch requests than this is too big for 2 cores
INHIBITOR_WAIT_S = 120.0  # how long the KV round waits for a critical of its model to resolve
# Prompt token ids: any vocabulary has these, and random ones share no cached prefix.
TOKEN_IDS = range(100, 1000)


@dataclass(frozen=True)
class KvPlan:
    """The batch load that fills a vLLM cache of ``blocks`` blocks of ``block_size`` tokens."""

    block_size: int
    blocks: int  # vLLM's num_gpu_blocks; one of them is its null block, never used

    @property
    def usable(self) -> int:
        return self.blocks - 1

    @property
    def running(self) -> int:
        return self.usable // BATCH_BLOCKS

    @property
    def clients(self) -> int:
        return self.running + BATCH_QUEUE

    @property
    def prompt_tokens(self) -> int:
        return (BATCH_BLOCKS - 1) * self.block_size + 1

    @property
    def output_tokens(self) -> tuple[int, int]:
        """Varied, so requests started together do not finish together, and never past the
        last block: prompt + output <= BATCH_BLOCKS * block_size."""
        top = self.block_size - 1
        return top * 3 // 4, top

    def usage(self, running: int) -> float:
        return running * BATCH_BLOCKS / self.usable

    def why_not(self) -> str:
        """Why this cache cannot be saturated by the round, or "" when it can."""
        if self.running > MAX_BATCH_RUNNING:
            return (
                f"vLLM's KV cache holds {self.usable * self.block_size:,} tokens ({self.running} batch "
                f"requests of {BATCH_BLOCKS} blocks), more than this machine keeps running; the stack "
                "caps it only when started without --kv-cache-gib"
            )
        # One request finishing drops usage by its blocks until vLLM admits the next one.
        if self.running < 2 or self.usage(self.running - 1) <= KV_CACHE_THRESHOLD:
            return (
                f"vLLM's KV cache of {self.usable} blocks holds {self.running} batch requests: one "
                f"finishing would take usage under the alert's {KV_CACHE_THRESHOLD:.0%}"
            )
        return ""

    def describe(self) -> str:
        lo, hi = self.output_tokens
        return (
            f"{self.clients} closed-loop batch requests to tiny-llm through the LLM sidecar (not streamed, "
            f"priority {BATCH_PRIORITY}, {self.prompt_tokens}-token prompts, {lo}-{hi} tokens out): "
            f"{self.running} fill {self.usage(self.running):.0%} of the {self.usable} usable "
            f"{self.block_size}-token blocks, {BATCH_QUEUE} wait"
        )


def read_kv_plan(info: StackInfo) -> KvPlan:
    """The cache's size from vLLM's cache-config info metric (its labels carry the values)."""
    text = httpx.get(info.url("vllm", "/metrics"), timeout=10.0, trust_env=False).text
    for family in text_string_to_metric_families(text):
        if family.name == contract.VLLM_CACHE_CONFIG.name and family.samples:
            labels = family.samples[0].labels
            return KvPlan(int(labels["block_size"]), int(labels["num_gpu_blocks"]))
    raise ValueError(f"vLLM's /metrics has no {contract.VLLM_CACHE_CONFIG.name}")


class BatchLoad(StreamLoadGenerator):
    """The round's batch requests: the stream load generator's closed loop, with a prompt of
    exact length in token ids and vLLM's ``priority`` field."""

    def __init__(self, info: StackInfo, plan: KvPlan, model: str) -> None:
        from reference_server.loadgen import LoadConfig, Target

        lo, hi = plan.output_tokens
        config = LoadConfig(
            url=info.url("llm_sidecar_http").removeprefix("http://"),
            protocol="openai",
            targets=[Target(model, "", 1.0)],
            concurrency=plan.clients,
            duration=None,
            timeout=60.0,
            stream=False,
            endpoint="completions",
            prompt_tokens="1",  # replaced by token ids below
            output_tokens=f"{lo}-{hi}",
            ignore_eos=True,
        )
        super().__init__(config)
        self.plan = plan
        self._ids = random.Random(7)

    async def _closed_loop(self, client, inputs, deadline: float | None) -> None:
        """The base class's closed loop, its senders started BATCH_RAMP_S apart: all at once,
        their prompts would meet in a few engine steps of thousands of prefill tokens, and an
        interactive stream's first token waits for such a step (measured: one stream over
        the 200 ms SLA, which early in a run is enough for tiny-llm's budget burn to page)."""

        async def worker(delay: float) -> None:
            await asyncio.sleep(delay)
            while not self._should_stop(deadline):
                target = self._pick()
                self.stats.on_send(target.label)
                await self._one(client, inputs, target, time.monotonic())

        assert self.config.concurrency is not None
        await asyncio.gather(*(worker(i * BATCH_RAMP_S) for i in range(self.config.concurrency)))

    def _request(self, target):  # type: ignore[override]
        path, body, _words = super()._request(target)
        n = self.plan.prompt_tokens
        body["prompt"] = [self._ids.choice(TOKEN_IDS) for _ in range(n)]
        body["priority"] = BATCH_PRIORITY
        return path, body, n


def priority_refused(info: StackInfo, model: str) -> str:
    """vLLM's answer to a request with a priority, when it refuses it (an engine running
    first-come-first-served scheduling does); "" when it is served."""
    body = {"model": model, "prompt": [TOKEN_IDS[0]], "max_tokens": 1, "priority": BATCH_PRIORITY}
    resp = httpx.post(info.url("vllm", "/v1/completions"), json=body, timeout=60.0, trust_env=False)
    return "" if resp.status_code == 200 else f"{resp.status_code} {resp.text[:200]}"


@dataclass
class LlmScenario:
    steady_s: float | None = None  # default: default_steady(spec)
    rate: float = 4.0  # tiny_stream streams per second (both versions)
    vllm_rate: float = 0.5  # vLLM streams per second (both served names): its CPU build is slow
    prompt_tokens: str = "8"
    output_tokens: str = "16"
    error_version: str = "1"
    error_after_tokens: int = 2
    ttft_version: str = "2"  # the canary
    ttft_ms: float = 2500.0  # above 2x the spec's TTFT SLA for tiny_stream (the default, 1 s)
    stagger_s: float = 5.0
    canary: bool = False  # the canary table is the main scenario's
    # The main Demo reads these names from its scenario.
    mix: tuple = ()


class StreamTraffic:
    """Open-loop token streams through both sidecars (reference_server.stream_load), each
    generator in its own thread, until stopped; the demo's Traffic interface."""

    def __init__(self, info: StackInfo, sc: LlmScenario) -> None:
        from reference_server.loadgen import LoadConfig, Target
        from reference_server.stream_load import StreamLoadGenerator

        def gen(url: str, protocol: str, targets: list, rate: float) -> StreamLoadGenerator:
            config = LoadConfig(
                url=url,
                protocol=protocol,
                targets=targets,
                rate=rate,
                duration=None,
                timeout=60.0,
                prompt_tokens=sc.prompt_tokens,
                output_tokens=sc.output_tokens,
            )
            return StreamLoadGenerator(config)

        llm_sidecar = info.url("llm_sidecar_http").removeprefix("http://")
        self._gens = {
            "triton-generate": gen(
                info.sidecar_http,
                "triton-generate",
                [Target(STREAM_MODEL, v, w) for v, w in STREAM_MIX],
                sc.rate,
            ),
            "openai": gen(llm_sidecar, "openai", [Target(n, "", w) for n, w in VLLM_MIX], sc.vllm_rate),
        }
        self.summary: dict = {}
        self.error = ""

    def start(self) -> None:
        for g in self._gens.values():
            g.start()

    def stop(self) -> None:
        for name, g in self._gens.items():
            try:
                self.summary[name] = g.stop(timeout=60).to_dict()
            except Exception as exc:  # the load generator's own failure, reported by the demo
                self.error = f"{name}: {type(exc).__name__}: {exc}"

    @property
    def alive(self) -> bool:
        return all(g.running for g in self._gens.values())


class LlmDemo(Demo):
    sc: LlmScenario  # type: ignore[assignment]
    _batch: BatchLoad | None = None
    _kv_plan: KvPlan | None = None

    def _plan(self) -> list[Fault]:
        sc, spec = self.sc, self.spec

        def fault(key: str, title: str, alertname: str, match: dict[str, str]) -> Fault:
            return Fault(
                key,
                title,
                alertname,
                contract.ALL_ALERTS[alertname],
                match,
                theoretical_minimum(spec, alertname),
                resolve_bound(spec, alertname),
            )

        # In the order of the rounds (_rounds), which is the final table's.
        return [
            fault(
                "kv-saturation",
                "KV-cache saturation: long-prompt batch requests fill vLLM's cache",
                contract.ALERT_LLM_KV_CACHE_SATURATION,
                # vLLM labels its series with its first served name, which is the model's name.
                {contract.L_MODEL: KV_MODEL},
            ),
            fault(
                "ttft-regression",
                f"TTFT regression: {STREAM_MODEL} v{sc.ttft_version} (canary) first token "
                f"after {sc.ttft_ms:g} ms",
                contract.ALERT_HIGH_TTFT,
                {contract.L_MODEL: STREAM_MODEL, contract.L_VERSION: sc.ttft_version},
            ),
            fault(
                "stream-errors",
                f"stream errors: {STREAM_MODEL} v{sc.error_version} fails after "
                f"{sc.error_after_tokens} tokens",
                contract.ALERT_HIGH_ERROR_RATE,
                {contract.L_MODEL: STREAM_MODEL, contract.L_VERSION: sc.error_version},
            ),
        ]

    def _rounds(self) -> list[list[Fault]]:
        # One model's critical inhibits its warnings and infos (alertmanager.yml: equal model):
        # the TTFT regression (tiny_stream) pages and resolves before tiny_stream's errors. The
        # KV round comes first and alone, so its load shares the CPU with no other fault and its
        # delay is measured alone.
        by_key = {f.key: f for f in self.faults}
        return [[by_key["kv-saturation"]], [by_key["ttft-regression"]], [by_key["stream-errors"]]]

    def _make_traffic(self) -> StreamTraffic:  # type: ignore[override]
        return StreamTraffic(self.info, self.sc)

    def _traffic_text(self) -> str:
        return (
            f"{self.sc.rate:g} {STREAM_MODEL} streams/s through the sidecar, "
            f"{self.sc.vllm_rate:g} vLLM streams/s through the LLM sidecar"
        )

    def _reset(self) -> None:
        self._stop_batch()
        clear_faults(self.info)

    def _prepare(self) -> None:
        """A few streams straight to vLLM (not through its sidecar, so no SLO counts them):
        its first requests after a start take up to a second (warm-up), which a 200 ms TTFT
        SLO would count against the budget of the steady phase."""
        self.reporter.event(f"warming up vLLM: {WARMUP_STREAMS} streams per served name")
        with httpx.Client(base_url=self.info.url("vllm"), timeout=120.0, trust_env=False) as client:
            for _ in range(WARMUP_STREAMS):
                for name, _w in VLLM_MIX:
                    body = {"model": name, "prompt": "the data value", "max_tokens": 8, "stream": True}
                    with client.stream("POST", "/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        for _line in resp.iter_lines():
                            pass
        saturation = next(f for f in self.faults if f.key == "kv-saturation")
        try:
            plan = read_kv_plan(self.info)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            saturation.skipped = f"could not read the size of vLLM's KV cache: {type(exc).__name__}: {exc}"
            return
        self._kv_plan = plan
        saturation.skipped = plan.why_not()
        if not saturation.skipped:
            refused = priority_refused(self.info, KV_MODEL)
            if refused:
                saturation.skipped = (
                    f"vLLM refused a request with a priority ({refused}): it schedules first come, first "
                    "served, and batch requests would hold up the interactive streams; restart the stack"
                )
        self.reporter.event(f"vLLM's KV cache: {plan.usable} usable blocks of {plan.block_size} tokens")

    def _recover(self) -> None:
        self._stop_batch()
        clear_faults(self.info)

    def _inject(self, f: Fault) -> None:
        sc = self.sc
        if f.skipped:
            self.reporter.event(f"skipped: {f.title}: {f.skipped}")
            return
        if f.key == "stream-errors":
            set_fault(self.info, STREAM_MODEL, sc.error_version, error_after_tokens=sc.error_after_tokens)
        elif f.key == "ttft-regression":
            set_fault(self.info, STREAM_MODEL, sc.ttft_version, ttft_ms=sc.ttft_ms)
        elif f.key == "kv-saturation":
            assert self._kv_plan is not None
            if not self._wait_for_no_inhibitor():
                return
            self._batch = BatchLoad(self.info, self._kv_plan, KV_MODEL).start()
            self.reporter.event(f"batch load: {self._kv_plan.describe()}")
        super()._injected(f)

    def _inhibitors(self) -> list[str]:
        """Critical alerts of the KV round's model now pending or firing: each would inhibit
        its info page (alertmanager.yml: a model's critical silences its warnings and infos)."""
        alerts, _rates = self.observer.snapshot()
        return sorted(
            {
                a.alertname
                for a in alerts.values()
                if a.labels.get("severity") == contract.SEVERITY_CRITICAL
                and a.labels.get(contract.L_MODEL) == KV_MODEL
            }
        )

    def _wait_for_no_inhibitor(self) -> bool:
        """Waits (up to INHIBITOR_WAIT_S) for a critical of tiny-llm that contention on this
        machine raised (its budget burn: the test names it) to resolve, as the rounds keep one
        model's critical apart from its lesser pages. False when the demo was stopped."""
        blocking = self._inhibitors()
        if not blocking:
            return True
        self.reporter.event(
            f"waiting: {', '.join(blocking)} [critical] on {KV_MODEL} would inhibit the KV page; the "
            f"round starts once it has resolved (at most {INHIBITOR_WAIT_S:g}s)"
        )
        end = time.time() + INHIBITOR_WAIT_S
        while blocking and time.time() < end:
            if not self._sleep(1.0):
                return False
            blocking = self._inhibitors()
        if blocking:
            self.reporter.event(f"starting anyway: {', '.join(blocking)} still pending or firing")
        return True

    def _stop_batch(self) -> None:
        """Stops sending batch requests; those in flight finish (the closed loop drains), so the
        cache empties as a finished batch job's would."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        try:
            summary = batch.stop(timeout=90).to_dict()
        except Exception as exc:  # the load generator's own failure, reported like the traffic's
            self.reporter.event(f"batch load failed: {type(exc).__name__}: {exc}")
            return
        if self.traffic is not None:
            self.traffic.summary["kv-batch"] = summary
        errors = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"
        self.reporter.event(
            f"batch load stopped: {summary['sent']} requests, {summary['ok']} answered, errors: {errors}"
        )
