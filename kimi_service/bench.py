"""`kimi-service bench`: a concurrency or request-rate sweep against an OpenAI-compatible streaming endpoint.
For each concurrency level a closed loop of that many clients sends the same prompt set; for each request
rate (open loop) the requests arrive as a Poisson process of that rate, whatever is still in flight, so
latency under load includes the time spent queued; per request
it records time to first token (TTFT), the gaps between streamed tokens (ITL), time per output token
(TPOT) and end-to-end latency. Per level it reports percentiles, output tokens/s, requests/s, errors
and goodput (requests/s that met every SLO). Prompts are made to exact token lengths with the
model's tokenizer, optionally behind one shared system prompt (the prefix-caching case).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kimi_service.credentials import bearer
from kimi_service.errors import KimiError, UsageError
from kimi_service.http_client import async_client_for, client_for

APIS = ("chat", "completions")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Per-request objectives in seconds; None means no objective on that measure.

    ttft, tpot and e2el are `vllm bench serve --goodput`'s terms (vllm/benchmarks/serve.py,
    calculate_metrics): a request is good when it succeeded and each measure given is at most its bound,
    TPOT being (latency - TTFT) / (output tokens - 1), 0 for a one-token answer. itl bounds every gap
    between streamed tokens: stricter (one slow step fails the whole request), and ours alone."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    TERMS = ("ttft", "tpot", "e2el", "itl")

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """`ttft=2,tpot=50ms,e2el=20,itl=0.1` (seconds; a `ms` suffix is accepted), or vLLM's own
        `ttft:2000 tpot:50` (milliseconds, as `vllm bench serve --goodput` takes them)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in re.split(r"[,\s]+", text.strip()):
            key, sep, raw = part.partition("=")
            milliseconds = not sep and ":" in part
            if milliseconds:
                key, _, raw = part.partition(":")
            key, raw = key.strip(), raw.strip()
            if not (sep or milliseconds) or key not in cls.TERMS:
                raise UsageError(f"--slo: expected ttft=SECONDS,tpot=SECONDS,e2el=SECONDS,itl=SECONDS "
                                 f"(or vLLM's ttft:MS), got {part!r}")
            try:
                if milliseconds or raw.endswith("ms"):
                    values[key] = float(raw.removesuffix("ms")) / 1000
                else:
                    values[key] = float(raw.rstrip("s"))
            except ValueError:
                raise UsageError(f"--slo: {key} must be a number of seconds (or 250ms), got {raw!r}") from None
            if not 0 < values[key] < math.inf:
                raise UsageError(f"--slo: {key} must be positive")
        return cls(**values)

    def met_by(self, result: RequestResult, *, itl: bool = True) -> bool:
        """Every objective met (`itl=False`: vLLM's terms alone)."""
        return result.ok and self.met_by_outcome(result.outcome(), itl=itl)

    def met_by_outcome(self, outcome: dict[str, Any], *, itl: bool = True) -> bool:
        """The same test on a request's recorded outcome (RequestResult.outcome)."""
        if not outcome["ok"]:
            return False
        bounds = [(self.ttft, outcome["ttft"]), (self.tpot, outcome["tpot"]), (self.e2el, outcome["e2e"])]
        if itl:
            bounds.append((self.itl, outcome["max_itl"]))
        return all(bound is None or value <= bound for bound, value in bounds)

    def describe(self) -> str:
        return ", ".join(f"{'max ITL' if term == 'itl' else term.upper()} <= {getattr(self, term)} s"
                         for term in self.TERMS if getattr(self, term) is not None) or "none"


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def outcome(self) -> dict[str, Any]:
        """What the SLO is judged on, kept per request so that goodput's spread can be resampled."""
        return {"ok": self.ok, "ttft": self.ttft, "tpot": self.tpot or 0.0, "e2e": self.e2e,
                "max_itl": max(self.itls, default=0.0)}


@dataclass
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(sum(values) / len(values), *(percentile(values, q) for q in PERCENTILES))


@dataclass
class LevelResult:
    concurrency: int  # closed loop: the clients; open loop: the most requests that were in flight at once
    requests: int
    errors: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    error_samples: list[str]
    request_rate: float | None = None  # requests/s offered (open loop); None for a closed loop
    # Under an ITL objective: requests/s that met vLLM's terms alone (what `vllm bench serve --goodput`
    # reports), beside goodput_requests_per_s, which also holds every gap to the ITL bound.
    vllm_goodput_requests_per_s: float | None = None
    outcomes: list[dict[str, Any]] = field(default_factory=list)  # each request's RequestResult.outcome()


@dataclass
class BenchReport:
    url: str
    model: str
    api: str
    input_len: int
    output_len: int
    shared_prefix_len: int
    slo: Slo
    levels: list[LevelResult]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    concurrency: int, results: Sequence[RequestResult], duration_s: float, slo: Slo, request_rate: float | None = None
) -> LevelResult:
    good = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in good)
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(good),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens for r in good),
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / duration_s,
        requests_per_s=len(good) / duration_s,
        goodput_requests_per_s=sum(1 for r in results if slo.met_by(r)) / duration_s,
        ttft_s=Distribution.of([r.ttft for r in good]),
        itl_s=Distribution.of([gap for r in good for gap in r.itls]),
        tpot_s=Distribution.of([t for r in good if (t := r.tpot) is not None]),
        e2e_s=Distribution.of([r.e2e for r in good]),
        error_samples=sorted({r.error for r in results if r.error})[:5],
        request_rate=request_rate,
        vllm_goodput_requests_per_s=(sum(1 for r in results if slo.met_by(r, itl=False)) / duration_s
                                     if slo.itl is not None else None),
        outcomes=[r.outcome() for r in results],
    )


# ------------------------------------------------------------------------------------------------
# Prompts


class Tokenizer:
    """The model's own tokenizer (Hugging Face format), loaded from a local directory."""

    def __init__(self, source: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise KimiError(
                "bench needs the `transformers` package to make prompts of exact token lengths; run it "
                "from the runtime venv (/opt/kimi-service/venv/bin/kimi-service) or pip install transformers"
            ) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=True)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load a tokenizer from {source!r}: {exc}. Pass --tokenizer DIR") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids)


def word_pool(tokenizer: Tokenizer, rng: random.Random, sample: int = 8192) -> list[int]:
    """Token ids that stay themselves when their text is concatenated and encoded again.

    Random ids decode to byte fragments and odd joins that re-encode to other lengths; a token that
    round-trips alone and starts a word (a leading space) keeps its own boundary in any sequence of
    such tokens, so a prompt made of them has the length it was made with.
    """
    special = tokenizer.special_ids
    candidates = rng.sample(range(tokenizer.vocab_size), min(sample, tokenizer.vocab_size))
    clean = []
    for token in candidates:
        if token in special:
            continue
        text = tokenizer.decode([token])
        if text.strip() and "\ufffd" not in text and tokenizer.encode(text) == [token]:
            clean.append(token)
    words = [token for token in clean if tokenizer.decode([token]).startswith(" ")]
    # Tokenizers without space-led tokens (SentencePiece strips the marker alone) fall back to every
    # clean token; text_of_length's correction loop then absorbs the odd merge.
    pool = words if len(words) >= 64 else clean
    if not pool:
        raise KimiError("the tokenizer has no token that encodes back to itself; cannot make prompts")
    return pool


def text_of_length(tokenizer: Tokenizer, length: int, rng: random.Random, pool: Sequence[int]) -> str:
    """Text that the tokenizer encodes to exactly `length` tokens (or the closest found)."""
    if length <= 0:
        return ""
    ids = [rng.choice(pool) for _ in range(length)]
    best, best_miss = "", length
    for _ in range(50):
        text = tokenizer.decode(ids)
        miss = len(tokenizer.encode(text)) - length
        if miss == 0:
            return text
        if abs(miss) < abs(best_miss):
            best, best_miss = text, miss
        # Too long: drop tokens from the end; too short: add more. Joins move by a few tokens at most.
        ids = ids[: len(ids) - miss] if miss > 0 else ids + [rng.choice(pool) for _ in range(-miss)]
    return best


def make_prompts(
    tokenizer: Tokenizer, count: int, input_len: int, shared_prefix_len: int = 0, seed: int = 0
) -> tuple[str, list[str]]:
    """(shared system prompt, per-request prompts), each of the asked token length."""
    rng = random.Random(seed)
    pool = word_pool(tokenizer, rng)
    prefix = text_of_length(tokenizer, shared_prefix_len, rng, pool)
    return prefix, [text_of_length(tokenizer, input_len, rng, pool) for _ in range(count)]


# ------------------------------------------------------------------------------------------------
# Requests


def _request_body(api: str, model: str, system: str, prompt: str, output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # vLLM extensions: generate exactly output_len tokens, so every run does the same work.
        "ignore_eos": True,
        "min_tokens": output_len,
    }
    if api == "chat":
        messages = [{"role": "system", "content": system}] if system else []
        body["messages"] = [*messages, {"role": "user", "content": prompt}]
    else:
        body["prompt"] = f"{system}\n\n{prompt}" if system else prompt
    return body


def _chunk_has_text(chunk: dict[str, Any]) -> bool:
    """A chunk carries generated tokens: answer text, reasoning, or a tool call's arguments (a server
    with a tool-call parser streams those as tool_calls deltas instead of content)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(key) for key in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


async def send_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> RequestResult:
    """One streamed request. TTFT ends at the first chunk that carries a choice: vLLM sends it when the
    first token exists, even when that token's text is empty (a special or half-UTF-8 token), which
    random-weight models produce for whole answers. Inter-token gaps are measured between chunks with
    text, so the role chunk vLLM sends just before the first text adds no artificial zero gap."""
    start = time.perf_counter()
    first: float | None = None
    last_text: float | None = None
    itls: list[float] = []
    chunks = 0
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                if not _chunk_has_text(chunk):
                    continue
                if last_text is not None:
                    itls.append(now - last_text)
                last_text = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(ok=False, error="the stream ended without any token")
    return RequestResult(
        ok=True,
        ttft=first - start,
        e2e=end - start,
        itls=itls,
        output_tokens=int(usage.get("completion_tokens") or chunks),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
    )


async def run_level(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """Send every body with at most `concurrency` in flight; returns results and wall time."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestResult] = []

    async def worker() -> None:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await send_request(client, path, body))
            on_done()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def arrival_gaps(count: int, rate: float, seed: int) -> list[float]:
    """Seconds before each of `count` requests of a Poisson process of `rate` requests/s (the first at 0)."""
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]


async def run_open_level(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[dict[str, Any]],
    gaps: Sequence[float],
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float, int]:
    """Send body i after gaps[i] more seconds, none waiting for another; returns results, wall time and the
    most requests in flight at once."""
    in_flight = peak = 0

    async def one(body: dict[str, Any]) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await send_request(client, path, body)
        finally:
            in_flight -= 1
            on_done()

    start = time.perf_counter()
    due = start
    tasks = []
    for body, gap in zip(bodies, gaps, strict=True):
        due += gap
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(body)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start, peak


class Progress:
    """A one-line progress bar on stderr (silent when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.done, self.label, self.stream = total, 0, label, stream
        self.enabled = stream.isatty()
        self.started = time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            elapsed = time.perf_counter() - self.started
            self.stream.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.1f}s"
            )
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------------------------------------
# The sweep


@dataclass
class BenchSettings:
    url: str
    model: str
    concurrency: list[int]  # closed-loop levels; not used when request_rates is given
    input_len: int
    output_len: int
    prompts: int
    api_key: str | None = None
    # Named in the message when the server refuses the key.
    api_key_env: str = "VLLM_API_KEY"
    shared_prefix_len: int = 0
    api: str = "chat"
    slo: Slo = field(default_factory=Slo)
    tokenizer: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    request_rates: list[float] = field(default_factory=list)  # open-loop levels, requests/s
    requests_per_client: int = 1  # closed loop: a level sends at least this many requests per client

    def validate(self) -> None:
        if not self.request_rates and (not self.concurrency or any(c < 1 for c in self.concurrency)):
            raise UsageError("--concurrency: a comma-separated list of positive integers, e.g. 1,4,16,64")
        if any(not (0 < rate < math.inf) for rate in self.request_rates):
            raise UsageError("--request-rate: a comma-separated list of positive requests/s, e.g. 1,2,4.5")
        for name in ("input_len", "output_len", "prompts"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.shared_prefix_len < 0:
            raise UsageError("--shared-prefix-len must not be negative")
        if self.api not in APIS:
            raise UsageError(f"--api must be one of {', '.join(APIS)}")


def level_requests(settings: BenchSettings, concurrency: int) -> int:
    """Requests a closed-loop level sends: --prompts, and at least requests_per_client per client."""
    return max(settings.prompts, settings.requests_per_client * concurrency)


def _key_refused(settings: BenchSettings, status: str) -> UsageError:
    return UsageError(
        f"{settings.url} refused the API key ({status}): set ${settings.api_key_env} to the server's key, "
        "or name the variable that holds it with --api-key-env"
    )


def _tokenizer_source(settings: BenchSettings, client: httpx.Client) -> str:
    if settings.tokenizer:
        return settings.tokenizer
    if Path(settings.model).is_dir():
        return settings.model
    # vLLM reports the directory it loaded the model from as the model's root.
    try:
        response = client.get("/v1/models")
        if response.status_code in (401, 403):
            raise _key_refused(settings, f"HTTP {response.status_code}")
        models = response.json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        raise KimiError(f"cannot reach {settings.url}/v1/models: {exc}") from None
    for entry in models:
        if entry.get("id") == settings.model and entry.get("root") and Path(entry["root"]).is_dir():
            return entry["root"]
    raise UsageError(
        f"no local tokenizer for {settings.model!r}: pass --tokenizer DIR (the model's directory)"
    )


def run_bench(settings: BenchSettings, progress: bool = True) -> BenchReport:
    settings.validate()
    headers = bearer(settings.api_key)
    base = settings.url.rstrip("/")
    with client_for(base, base_url=base, headers=headers, timeout=30) as probe:
        tokenizer = Tokenizer(_tokenizer_source(settings, probe))
    count = settings.prompts if settings.request_rates else level_requests(settings, max(settings.concurrency))
    system, prompts = make_prompts(tokenizer, count, settings.input_len, settings.shared_prefix_len, settings.seed)
    bodies = [_request_body(settings.api, settings.model, system, p, settings.output_len) for p in prompts]
    path = "/v1/chat/completions" if settings.api == "chat" else "/v1/completions"

    async def sweep() -> list[LevelResult]:
        limits = httpx.Limits(max_connections=max(settings.concurrency) + 4, max_keepalive_connections=None)
        async with async_client_for(
            base, base_url=base, headers=headers, timeout=settings.timeout_s, limits=limits
        ) as client:
            warmup = await send_request(client, path, bodies[0])
            if warmup.error and warmup.error.startswith(("HTTP 401", "HTTP 403")):
                raise _key_refused(settings, warmup.error[:8])
            if not warmup.ok:
                raise KimiError(f"the warm-up request to {base}{path} failed: {warmup.error}")
            levels = []
            for index, rate in enumerate(settings.request_rates):
                bar = Progress(len(bodies), f"{rate:g} requests/s")
                gaps = arrival_gaps(len(bodies), rate, settings.seed + index)
                results, duration, peak = await run_open_level(
                    client, path, bodies, gaps, bar.advance if progress else (lambda: None)
                )
                levels.append(summarize(peak, results, duration, settings.slo, request_rate=rate))
            for concurrency in [] if settings.request_rates else settings.concurrency:
                batch = bodies[: level_requests(settings, concurrency)]
                bar = Progress(len(batch), f"concurrency {concurrency:>3}")
                results, duration = await run_level(
                    client, path, batch, concurrency, bar.advance if progress else (lambda: None)
                )
                levels.append(summarize(concurrency, results, duration, settings.slo))
            return levels

    levels = asyncio.run(sweep())
    return BenchReport(
        url=base, model=settings.model, api=settings.api, input_len=settings.input_len,
        output_len=settings.output_len, shared_prefix_len=settings.shared_prefix_len,
        slo=settings.slo, levels=levels,
    )


# ------------------------------------------------------------------------------------------------
# Output
