"""The statistics and argument handling of `kimi-service bench` (the sweep itself runs in tests/engine)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimi_service.bench import BenchSettings, RequestResult, Slo, percentile, summarize
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
