"""Load for token streams: the OpenAI-compatible API (vLLM and others) and Triton's generate
endpoints (the tiny_stream model), measured on the client side.

The sending loops (open loop with Poisson arrivals, closed loop) are ``loadgen.LoadGenerator``'s;
this module brings the requests and what is measured on each:

- **TTFT**: from the request's scheduled time (open loop) or its start (closed loop) to the first
  event that carries generated text. vLLM's first chat event carries only the role, so it does
  not count.
- **TPOT**, per request: (last token's arrival - first token's) / (output tokens - 1), over
  requests with at least two tokens. Output tokens come from ``usage`` when the answer has it
  (``stream_options.include_usage`` is asked for), else from the events.
- **Inter-token gaps**: every gap between two content events.
- **Errors**: an HTTP status other than 200 is counted by status; an error event inside a 200
  stream (vLLM: ``data: {"error": ...}``; Triton: ``data: {"error": "..."}``) as ``stream_error``;
  a stream cut after its 200, or an OpenAI stream that ends without ``data: [DONE]``, as
  ``incomplete_stream``; an event that is not a JSON object as ``bad_event``.

Without ``stream`` each request gets one answer: only latency and token counts are measured.
Lines (LF or CRLF, split anywhere across reads) come from httpx's line reader; events are
dispatched at their blank line as the SSE standard says (comments skipped, ``data:`` lines
joined, an event cut off by the end of the stream dropped).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from dataclasses import dataclass, replace

import httpx

from reference_server.loadgen import (
    LoadConfig,
    LoadError,
    LoadGenerator,
    Stats,
    Summary,
    Target,
    error_label,
    percentiles,
)

# Words that the tiny model's tokenizer (trained on Python's sources) mostly keeps whole, so a
# prompt of N words is close to N tokens; the server's usage says exactly how many it counted.
_TEXT = (
    "the data value return self import class def for in if else list from with none true false "
    "string number model token server request stream error time first second per output input "
    "batch queue cache memory file path name type test result"
)
_WORDS = tuple(_TEXT.split(" "))
_LENGTHS = re.compile(r"^(?:(?P<n>\d+)|(?P<lo>\d+)-(?P<hi>\d+)|normal:(?P<mean>[0-9.]+):(?P<sd>[0-9.]+))$")
MAX_LENGTH = 100_000


@dataclass(frozen=True, slots=True)
class Lengths:
    """A distribution of token counts: ``N`` (fixed), ``A-B`` (uniform, both included) or
    ``normal:MEAN:SD`` (rounded, at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str) -> Lengths:
        m = _LENGTHS.match(text.strip())
        if not m:
            raise LoadError(
                f"{what} {text!r}: expected N, A-B or normal:MEAN:SD (e.g. 128, 16-256, normal:64:16)"
            )
        if m["n"]:
            out = cls("fixed", int(m["n"]))
        elif m["lo"]:
            out = cls("uniform", int(m["lo"]), int(m["hi"]))
            if out.a > out.b:
                raise LoadError(f"{what} {text!r}: the low end is above the high end")
        else:
            out = cls("normal", float(m["mean"]), float(m["sd"]))
        if not 1 <= out.a <= MAX_LENGTH or out.b > MAX_LENGTH:
            raise LoadError(f"{what} {text!r}: lengths must be between 1 and {MAX_LENGTH}")
        return out

    def sample(self, rng) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


def prompt_of(n: int, rng) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class StreamStats(Stats):
    def __init__(self) -> None:
        super().__init__()
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.gaps: list[float] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def on_tokens(self, ttft: float | None, times: list[float], prompt: int, generated: int) -> None:
        with self.lock:
            if ttft is not None:
                self.ttft.append(ttft)
            if len(times) >= 2 and generated >= 2:
                self.tpot.append((times[-1] - times[0]) / (generated - 1))
            self.gaps.extend(b - a for a, b in itertools.pairwise(times))
            self.prompt_tokens += prompt
            self.generation_tokens += generated


class StreamError(Exception):
    """The server answered 200 and then reported an error, or cut the stream short."""

    def __init__(self, label: str, message: str) -> None:
        super().__init__(message)
        self.label = label


class _Client:
    """One pooled httpx client for every request of a run."""

    def __init__(self, base: str, limit: int, timeout: float) -> None:
        self.base = base
        self.http = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        )

    async def close(self) -> None:
        await self.http.aclose()


class StreamLoadGenerator(LoadGenerator):
    """``LoadGenerator`` for the ``openai`` and ``triton-generate`` protocols."""

    def __init__(self, config: LoadConfig, stop_event=None) -> None:
        super().__init__(config, stop_event)
        self.stats = StreamStats()
        self.prompt_lengths = Lengths.parse(config.prompt_tokens, "prompt tokens")
        self.output_lengths = Lengths.parse(config.output_tokens, "output tokens")

    def snapshot(self) -> Summary:
        summary = super().snapshot()
        s = self.stats
        with s.lock:
            ttft, tpot, gaps = list(s.ttft), list(s.tpot), list(s.gaps)
            prompt, generated = s.prompt_tokens, s.generation_tokens
        streamed = self.config.stream
        return replace(
            summary,
            ttft_s=percentiles(ttft) if streamed else None,
            tpot_s=percentiles(tpot) if streamed else None,
            inter_token_s=percentiles(gaps) if streamed else None,
            prompt_tokens=prompt,
            generation_tokens=generated,
            generation_tokens_per_s=generated / max(summary.elapsed_s, 1e-9),
        )

    def _make_client(self):
        c = self.config
        return _Client(f"http://{c.url}", c.concurrency or c.max_in_flight, c.timeout), None

    def _request(self, target: Target) -> tuple[str, dict, int]:
        """(path, JSON body, prompt words) for one request to ``target``."""
        c = self.config
        n_prompt = self.prompt_lengths.sample(self._rng)
        n_out = self.output_lengths.sample(self._rng)
        prompt = prompt_of(n_prompt, self._rng)
        if c.protocol == "triton-generate":
            version = f"/versions/{target.version}" if target.version else ""
            path = f"/v2/models/{target.model}{version}/" + ("generate_stream" if c.stream else "generate")
            return path, {"text_input": prompt, "max_tokens": n_out, "stream": c.stream}, n_prompt
        body: dict = {"model": target.model, "max_tokens": n_out, "stream": c.stream}
        if c.endpoint == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        if c.stream:
            body["stream_options"] = {"include_usage": True}
        if c.ignore_eos:
            body["ignore_eos"] = True
        return path, body, n_prompt

    async def _one(self, client: _Client, inputs, target: Target, t0: float) -> None:
        path, body, n_prompt = self._request(target)
        error = None
        try:
            await asyncio.wait_for(self._exchange(client, path, body, n_prompt, t0), self.config.timeout)
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        except StreamError as exc:
            error = exc.label
        except httpx.TimeoutException:
            error = "timeout"
        except httpx.HTTPError:
            error = "connection_error"
        except Exception as exc:
            error = error_label(exc)
        finally:
            self.stats.on_done(target.label, time.monotonic() - t0, error)

    async def _exchange(self, client: _Client, path: str, body: dict, n_prompt: int, t0: float) -> None:
        openai = self.config.protocol == "openai"
        if not self.config.stream:
            resp = await client.http.post(path, json=body)
            if resp.status_code != 200:
                raise StreamError(str(resp.status_code), resp.text[:200])
            data = resp.json()
            if "error" in data:  # Triton's generate: an error body inside a 200
                raise StreamError("stream_error", str(data["error"])[:200])
            prompt, generated = _usage(data) if openai else (n_prompt, len(data["text_output"].split()))
            self.stats.on_tokens(None, [], prompt, generated)
            return
        times: list[float] = []
        usage = None
        done = False
        async with client.http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise StreamError(str(resp.status_code), resp.text[:200])
            try:
                lines: list[str] = []  # the data lines of the event being read
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line[6:] if line.startswith("data: ") else line[5:])
                        continue
                    if line or not lines:
                        continue  # a comment (":"), another field, or a blank line with no event
                    data, lines = "\n".join(lines), []  # a blank line ends the event: handle it
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise StreamError("bad_event", f"not JSON: {data[:100]!r}") from None
                    if not isinstance(event, dict):
                        raise StreamError("bad_event", f"not a JSON object: {data[:100]!r}")
                    if "error" in event:
                        raise StreamError("stream_error", str(event["error"])[:200])
                    if openai:
                        usage = event.get("usage") or usage
                        if _has_content(event):
                            times.append(time.monotonic())
                    elif event.get("text_output"):
                        times.append(time.monotonic())
                # An event cut off by the end of the stream (no blank line after it) is dropped,
                # as the SSE standard says; Triton's stream has no end marker, so it ends here.
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                # After the 200: the server went away mid-stream (not a connection failure).
                raise StreamError("incomplete_stream", str(exc)[:200]) from None
        if openai and not done:
            raise StreamError("incomplete_stream", "the stream ended without data: [DONE]")
        prompt, generated = _usage({"usage": usage}) if usage else (0 if openai else n_prompt, len(times))
        self.stats.on_tokens(times[0] - t0 if times else None, times, prompt, generated)


def _has_content(event: dict) -> bool:
    for choice in event.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


def _usage(data: dict) -> tuple[int, int]:
    usage = data.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def check_served(url: str, protocol: str, targets: list[Target], timeout: float = 5.0) -> None:
    """Raise LoadError unless the server answers and serves every target."""
    base = f"http://{url}"
    try:
        if protocol == "openai":
            resp = httpx.get(f"{base}/v1/models", timeout=timeout)
            resp.raise_for_status()
            served = {m.get("id") for m in resp.json().get("data", [])}
            missing = sorted({t.model for t in targets} - served)
            if missing:
                names = ", ".join(sorted(map(str, served)))
                raise LoadError(f"{', '.join(missing)} not served at {url} (it serves: {names})")
        else:
            for t in targets:
                version = f"/versions/{t.version}" if t.version else ""
                resp = httpx.get(f"{base}/v2/models/{t.model}{version}/ready", timeout=timeout)
                if resp.status_code != 200:
                    raise LoadError(f"model {t.label} is not ready at {url} (HTTP {resp.status_code})")
    except (httpx.HTTPError, ValueError) as exc:
        if isinstance(exc, LoadError):
            raise
        what = "an OpenAI-compatible server" if protocol == "openai" else "Triton"
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise LoadError(f"cannot reach {what} at {url}: {reason}") from None


def token_lines(s: Summary) -> list[str]:
    """The summary's token-stream lines, for the CLI."""

    def ms(p: dict[str, float] | None) -> str:
        if not p:
            return "-"
        return "   ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p.items())

    lines = []
    if s.ttft_s is not None:
        lines += [
            f"  time to first token   {ms(s.ttft_s)}",
            f"  time per output token {ms(s.tpot_s)}",
            f"  inter-token gap       {ms(s.inter_token_s)}",
        ]
    per_request = s.generation_tokens / s.ok if s.ok else math.nan
    lines.append(
        f"  tokens: prompt {s.prompt_tokens}, generated {s.generation_tokens} "
        f"({per_request:.1f} per ok request, {s.generation_tokens_per_s:.1f}/s)"
    )
    return lines
