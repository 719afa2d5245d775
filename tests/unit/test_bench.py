"""The statistics and argument handling of `kimi-service bench`, and the open loop's schedule against a local
HTTP server that streams like an engine (the sweep against vLLM itself runs in tests/engine)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimi_service.bench import (
    BenchReport,
    BenchSettings,
    RequestResult,
    Slo,
    arrival_gaps,
    percentile,
    run_open_level,
    summarize,
)
from kimi_service.bench_report import format_table
from kimi_service.errors import UsageError


def test_percentile_interpolates_between_ranks():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 50) == 25.0
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 90) == pytest.approx(37.0)
    assert math.isnan(percentile([], 50))


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1), st.floats(min_value=0, max_value=100))
def test_percentile_stays_within_the_data(values, q):
    assert min(values) <= percentile(values, q) <= max(values)


def test_slo_parsing():
    assert Slo.parse("ttft=2,itl=100ms") == Slo(ttft=2.0, itl=0.1)
    assert Slo.parse(None) == Slo()
    for bad in ("ttft", "e2e=1", "ttft=fast", "itl=-1"):
        with pytest.raises(UsageError):
            Slo.parse(bad)


def test_slo_parsing_takes_vllms_goodput_terms_in_seconds_or_its_milliseconds():
    assert Slo.parse("tpot=50ms,e2el=20") == Slo(tpot=0.05, e2el=20.0)
    # `vllm bench serve --goodput ttft:1000 tpot:100 e2el:30000`: milliseconds, space-separated.
    assert Slo.parse("ttft:1000") == Slo(ttft=1.0)
    assert Slo.parse("ttft:1000 tpot:100 e2el:30000") == Slo(ttft=1.0, tpot=0.1, e2el=30.0)
    for bad in ("tpot", "tpot:", "e2el:-5", "ttft:fast", "goodput:1", "tpot=0", "e2el=inf"):
        with pytest.raises(UsageError, match="--slo"):
            Slo.parse(bad)


def test_a_malformed_slo_exits_2_with_one_line_before_any_request():
    result = subprocess.run([sys.executable, "-m", "kimi_service", "bench", "--model", "m", "--url",
                             "http://127.0.0.1:9", "--slo", "tpot:abc"], capture_output=True, text=True,
                            timeout=60, check=False, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2 and "--slo" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_vllms_goodput_counts_requests_within_every_bound_with_tpot_after_the_first_token():
    # TPOT = (latency - TTFT) / (tokens - 1): (2.1 - 0.1) / 4 = 0.5 s.
    slow_tokens = RequestResult(ok=True, ttft=0.1, e2e=2.1, itls=[0.5] * 4, output_tokens=5, prompt_tokens=5)
    assert slow_tokens.tpot == pytest.approx(0.5)
    one_token = RequestResult(ok=True, ttft=0.2, e2e=0.2, output_tokens=1, prompt_tokens=5)
    assert one_token.outcome()["tpot"] == 0.0  # vLLM's 0 for a one-token answer: never over a TPOT bound
    fast = RequestResult(ok=True, ttft=0.1, e2e=0.5, itls=[0.1, 0.3], output_tokens=3, prompt_tokens=5)  # TPOT 0.2
    late = RequestResult(ok=True, ttft=0.9, e2e=1.3, itls=[0.2, 0.2], output_tokens=3, prompt_tokens=5)
    failed = RequestResult(ok=False, error="HTTP 500")
    slo = Slo(ttft=0.5, tpot=0.25, e2el=1.0, itl=0.25)
    level = summarize(8, [slow_tokens, one_token, fast, late, failed], duration_s=2.0, slo=slo)
    # vLLM's terms: one_token and fast are within TTFT, TPOT and E2EL; slow_tokens breaks TPOT and E2EL, late
    # TTFT and E2EL, failed failed. Ours also holds every gap to the ITL bound: fast's 0.3 s gap breaks it.
    assert level.vllm_goodput_requests_per_s == pytest.approx(2 / 2.0)
    assert level.goodput_requests_per_s == pytest.approx(1 / 2.0)
    assert summarize(8, [fast], 2.0, Slo(tpot=0.25)).vllm_goodput_requests_per_s is None  # only beside an ITL bound
    assert summarize(8, [fast], 2.0, Slo(tpot=0.1, itl=1.0)).vllm_goodput_requests_per_s == 0.0


def _ok(ttft, itls, tokens):
    return RequestResult(ok=True, ttft=ttft, e2e=ttft + sum(itls), itls=itls, output_tokens=tokens, prompt_tokens=5)


def test_summary_counts_goodput_errors_and_throughput():
    results = [
        _ok(0.1, [0.01, 0.02], 3),  # meets both objectives
        _ok(0.5, [0.01, 0.01], 3),  # TTFT too slow
        _ok(0.1, [0.01, 0.30], 3),  # one inter-token gap too slow
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    level = summarize(4, results, duration_s=2.0, slo=Slo(ttft=0.2, itl=0.05))
    assert level.requests == 4 and level.errors == 1
    assert level.output_tokens == 9
    assert level.output_tokens_per_s == pytest.approx(4.5)
    assert level.requests_per_s == pytest.approx(1.5)
    assert level.goodput_requests_per_s == pytest.approx(0.5)
    assert level.ttft_s.p50 == pytest.approx(0.1)
    assert level.tpot_s.p50 == pytest.approx(0.015)
    assert level.error_samples == ["HTTP 500: boom"]


def test_settings_reject_bad_values():
    base = dict(url="http://x", model="m", concurrency=[1], input_len=8, output_len=8, prompts=4)
    BenchSettings(**base).validate()
    for change in ({"concurrency": []}, {"concurrency": [0]}, {"input_len": 0}, {"api": "grpc"},
                   {"shared_prefix_len": -1}):
        with pytest.raises(UsageError):
            BenchSettings(**{**base, **change}).validate()


def test_arrivals_are_a_seeded_poisson_process():
    gaps = arrival_gaps(4000, rate=8.0, seed=3)
    assert gaps[0] == 0.0 and len(gaps) == 4000
    assert gaps == arrival_gaps(4000, rate=8.0, seed=3) != arrival_gaps(4000, rate=8.0, seed=4)
    assert statistics.mean(gaps[1:]) == pytest.approx(1 / 8, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (a fixed pacing would have none).
    assert statistics.stdev(gaps[1:]) == pytest.approx(1 / 8, rel=0.1)


class SlowStream(BaseHTTPRequestHandler):
    """Streams three chat chunks over SERVICE_S seconds, like an engine that takes that long per request."""

    SERVICE_S = 0.4

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ("a", "b", "c"):
            time.sleep(self.SERVICE_S / 3)
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n')
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_open_loop_sends_on_schedule_whatever_is_in_flight():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    gaps = [0.0, 0.1, 0.1, 0.1]

    async def level() -> tuple[list, float, int]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await run_open_level(client, "/v1/chat/completions", [{"n": i} for i in range(4)], gaps)

    try:
        results, duration, peak = asyncio.run(level())
    finally:
        server.shutdown()
        server.server_close()
    assert [r.ok for r in results] == [True] * 4 and sum(r.output_tokens for r in results) == 12
    # A closed loop of one client would take 4 x 0.4 s; arrivals every 0.1 s overlap all four.
    assert peak == 4
    assert sum(gaps) + SlowStream.SERVICE_S <= duration < 4 * SlowStream.SERVICE_S
    level_result = summarize(peak, results, duration, Slo(), request_rate=10.0)
    table = format_table(BenchReport(url=url, model="m", api="chat", input_len=8, output_len=3,
                                     shared_prefix_len=0, slo=Slo(), levels=[level_result]))
    assert table.splitlines()[-1].split()[:3] == ["10", "4", "4"]


def test_request_rates_must_be_positive_and_finite():
    base = dict(url="http://x", model="m", concurrency=[], input_len=8, output_len=8, prompts=4)
    BenchSettings(**base, request_rates=[0.5, 2]).validate()
    for rates in ([0.0], [-1.0], [math.inf]):
        with pytest.raises(UsageError, match="request-rate"):
            BenchSettings(**base, request_rates=rates).validate()
