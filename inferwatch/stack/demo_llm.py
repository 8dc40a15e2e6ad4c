"""``inferwatch demo --scenario llm``: an LLM incident on a stack started with ``up --llm``.

Steady token streams through both sidecars: Triton's streaming model ``tiny_stream`` (v1
stable, v2 canary) through the stack's sidecar (``triton-generate``), and the real vLLM's
two served names (``tiny-llm`` and its canary name) through the LLM sidecar (``openai``).
Then the faults, through Triton's fault knobs on ``tiny_stream``, one round each (a model's
critical inhibits its warnings, so played together the TTFT page would never be sent):
v2's first token comes seconds late (InferenceHighTTFT: warning), cleared and resolved;
then every v1 stream ends with an error after a few tokens (the error-rate tier counts a
stream's error event as a server_error: critical), cleared and resolved. The pages and the
final table are the main demo's (``demo.py``).

KV-cache saturation (LLMKVCacheSaturation, info) is planned and reported as skipped: vLLM's
CPU build reads its KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE), and one GiB holds
about 262,000 tokens of the tiny model (2 layers x 256 hidden x K and V x 4 bytes = 4 KiB a
token), some 500 concurrent sequences of its 512-token maximum: far more than a 2-core
machine runs in the demo's minutes. vLLM's ``--num-gpu-blocks-override`` does shrink it on
this build (16 blocks: 2,048 tokens, 4 sequences of 512, seen in its log and its cache-config
info metric), and ``inferwatch vllm --kv-cache-blocks N`` now passes it through; a saturation
round still needs writing (and must keep tiny-llm's TTFT budget page, a critical, from
inhibiting the info page).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from inferwatch import contract
from inferwatch.stack.core import StackInfo
from inferwatch.stack.demo import Demo, Fault, clear_faults, set_fault
from inferwatch.stack.timing import resolve_bound, theoretical_minimum

STREAM_MODEL = "tiny_stream"
# The main sidecar's streams: (version, weight); the LLM sidecar's: (served name, weight).
STREAM_MIX = (("1", 1.0), ("2", 1.0))
VLLM_MIX = (("tiny-llm", 1.0), ("tiny-llm-canary", 1.0))
WARMUP_STREAMS = 4

SATURATION_SKIPPED = (
    "vLLM's CPU build sizes its KV cache in whole GiB: 1 GiB holds ~262k tokens of the tiny "
    "model, ~500 concurrent 512-token sequences, beyond this machine; `inferwatch vllm` does not "
    "yet pass --num-gpu-blocks-override"
)


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

        saturation = fault(
            "kv-saturation",
            "KV-cache saturation: long prompts to vLLM",
            contract.ALERT_LLM_KV_CACHE_SATURATION,
            {contract.L_MODEL: "tiny-llm"},
        )
        saturation.skipped = SATURATION_SKIPPED
        return [
            fault(
                "stream-errors",
                f"stream errors: {STREAM_MODEL} v{sc.error_version} fails after "
                f"{sc.error_after_tokens} tokens",
                contract.ALERT_HIGH_ERROR_RATE,
                {contract.L_MODEL: STREAM_MODEL, contract.L_VERSION: sc.error_version},
            ),
            fault(
                "ttft-regression",
                f"TTFT regression: {STREAM_MODEL} v{sc.ttft_version} (canary) first token "
                f"after {sc.ttft_ms:g} ms",
                contract.ALERT_HIGH_TTFT,
                {contract.L_MODEL: STREAM_MODEL, contract.L_VERSION: sc.ttft_version},
            ),
            saturation,
        ]

    def _rounds(self) -> list[list[Fault]]:
        # One model's critical inhibits its warnings (alertmanager.yml: equal model), and
        # both faults are on tiny_stream: the TTFT regression pages and resolves first.
        by_key = {f.key: f for f in self.faults}
        return [[by_key["ttft-regression"], by_key["kv-saturation"]], [by_key["stream-errors"]]]

    def _make_traffic(self) -> StreamTraffic:  # type: ignore[override]
        return StreamTraffic(self.info, self.sc)

    def _traffic_text(self) -> str:
        return (
            f"{self.sc.rate:g} {STREAM_MODEL} streams/s through the sidecar, "
            f"{self.sc.vllm_rate:g} vLLM streams/s through the LLM sidecar"
        )

    def _reset(self) -> None:
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

    def _recover(self) -> None:
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
        super()._injected(f)
