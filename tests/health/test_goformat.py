"""Go's spelling of durations, floats and times, pinned with values Go itself prints."""

from __future__ import annotations

import pytest

from agent.goformat import DurationError, format_duration, format_float, format_time, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("1m30s", 90),
        ("1h0m0s", 3600),
        ("24h0m0s", 86400),
        ("250ms", 0.25),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("2h22m", 8520),
        ("1us", 1e-6),
        ("1µs", 1e-6),
        ("100ns", 1e-7),
        ("-1.5h", -5400),
        ("+5s", 5),
        ("0", 0),
        ("0s", 0),
    ],
)
def test_parse_duration_as_time_ParseDuration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("30", "missing unit in duration '30'"),
        ("1m30", "missing unit in duration '1m30'"),
        ("30x", "unknown unit 'x' in duration '30x'"),
        ("", "invalid duration ''"),
        ("-", "invalid duration '-'"),
        ("abc", "invalid duration 'abc'"),
        (".s", "invalid duration '.s'"),
        ("3000000h", "larger than Go's maximum"),
    ],
)
def test_parse_duration_errors_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(DurationError) as exc:
        parse_duration(text)
    assert message in str(exc.value)
    assert "e.g. 30s" in str(exc.value) or "maximum" in str(exc.value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (1, "1s"),
        (30, "30s"),
        (1.5, "1.5s"),
        (60, "1m0s"),
        (90, "1m30s"),
        (900, "15m0s"),
        (3600, "1h0m0s"),
        (86400, "24h0m0s"),
        (7200.5, "2h0m0.5s"),
        (0.25, "250ms"),
        (0.1, "100ms"),
        (0.0005, "500µs"),
        (1.5e-6, "1.5µs"),
        (1e-7, "100ns"),
        (-30, "-30s"),
    ],
)
def test_format_duration_as_Duration_String(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1, "1"),
        (-1, "-1"),
        (0.001, "0.001"),
        (0.25, "0.25"),
        (16.384, "16.384"),
        (100, "100"),
        (123456, "123456"),
        (1234567, "1.234567e+06"),
        (1e6, "1e+06"),
        (1_048_576, "1.048576e+06"),
        (1.5e9, "1.5e+09"),
        (1732275123.456, "1.732275123456e+09"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (2.5e-7, "2.5e-07"),
        (float("inf"), "+Inf"),
        (float("-inf"), "-Inf"),
        (float("nan"), "NaN"),
    ],
)
def test_format_float_as_go_prometheus_client(value: float, text: str) -> None:
    assert format_float(value) == text


def test_format_time_as_time_MarshalJSON() -> None:
    assert format_time(0) == "0001-01-01T00:00:00Z"
    assert format_time(1_714_557_600 * 10**9) == "2024-05-01T10:00:00Z"
    assert format_time(1_714_557_600 * 10**9 + 500_000_000) == "2024-05-01T10:00:00.5Z"
    assert format_time(1_714_557_600 * 10**9 + 123_456_789) == "2024-05-01T10:00:00.123456789Z"
