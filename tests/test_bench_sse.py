"""`titan bench` SSE parsing and event handling, including malformed streams, and the Prometheus parser."""

import math

import pytest

from titan.bench.client import (
    RequestResult,
    SseParser,
    _apply_event,
    _StreamFailure,
    api_root,
    endpoint_url,
    error_message,
    request_body,
)
from titan.bench.metrics_scraper import MetricsReducer, max_bound, parse_prometheus_text, read_lines
from titan.bench.workload import RequestSpec

STREAM = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"choices":[{"text":"Hel"}]}\r\n\r\n'
    b'data: {"choices":[{"text":"lo \xc3\xa9"}]}\n\n'
    b"event: message\ndata: first line\ndata: second line\n\n"
    b'data:{"choices":[{"text":"","finish_reason":"length"}]}\r\r'
    b"data: [DONE]\n\n"
)
EXPECTED = ['{"choices":[{"text":"Hel"}]}', '{"choices":[{"text":"lo \u00e9"}]}', "first line\nsecond line",
            '{"choices":[{"text":"","finish_reason":"length"}]}', "[DONE]"]


def feed_in_pieces(data: bytes, size: int) -> list[str]:
    parser = SseParser()
    events = []
    for start in range(0, len(data), size):
        events += parser.feed(data[start:start + size])
    return events + parser.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_sse_parser_is_independent_of_chunking(size: int) -> None:
    # Every split point is covered at size 1: CRLF halves, the two bytes of 'é', 'data:' itself.
    assert feed_in_pieces(STREAM, size) == EXPECTED


def test_sse_parser_edge_cases() -> None:
    parser = SseParser()
    assert parser.feed(b"data: a\r") == []  # the CR could be half a CRLF: wait for the next byte
    assert parser.feed(b"\ndata: b\n\n") == ["a\nb"]  # ... it was: still one event of two lines
    assert parser.feed(b"") == []
    assert parser.feed(b"data: tail-without-blank-line") == []
    assert parser.close() == ["tail-without-blank-line"]
    parser = SseParser()
    assert parser.feed(b'{"choices": []}\n\n') == []  # JSON without "data:" is no event at all
    assert parser.feed(b"data: \xff\xfe\n\n") == ["\ufffd\ufffd"]  # invalid UTF-8 is replaced, not fatal


def fresh() -> RequestResult:
    return RequestResult(0, "default", 4, 8, 0.0, sent_at=0.0)


def test_events_fill_the_result() -> None:
    result = fresh()
    assert not _apply_event('{"choices":[{"delta":{"role":"assistant"}}]}', result, 0.1)  # role only: no token
    assert not _apply_event('{"choices":[{"delta":{"content":"Hi"}}]}', result, 0.2)
    assert not _apply_event('{"choices":[{"delta":{"reasoning_content":"hm"}}]}', result, 0.3)
    assert not _apply_event('{"choices":[{"text":" there","finish_reason":"stop"}]}', result, 0.4)
    assert not _apply_event('{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}', result, 0.5)
    assert _apply_event("[DONE]", result, 0.6)
    assert result.token_times == [0.2, 0.3, 0.4]
    assert (result.prompt_tokens, result.completion_tokens, result.usage_source) == (5, 3, "usage")
    assert result.finish_reason == "stop" and result.output_chars == 10
    assert not _apply_event('{"choices":[{"text":"x"}],"usage":null}', result, 0.7)


@pytest.mark.parametrize(("data", "kind"), [
    ("{not json", "malformed_sse"),
    ('"just a string"', "malformed_sse"),
    ('{"choices": {"text": "x"}}', "malformed_sse"),
    ('{"choices": ["x"]}', "malformed_sse"),
    ('{"choices": [{"delta": "x"}]}', "malformed_sse"),
    ('{"error": {"message": "engine died", "type": "server_error"}}', "stream_error"),
    ('{"error": "plain"}', "stream_error"),
])
def test_malformed_and_error_events_raise_a_typed_failure(data: str, kind: str) -> None:
    with pytest.raises(_StreamFailure) as caught:
        _apply_event(data, fresh(), 0.1)
    assert caught.value.kind == kind


def test_error_messages_from_common_servers() -> None:
    assert error_message(400, b'{"error":{"message":"prompt too long","type":"invalid_request_error"}}') == \
        "HTTP 400: prompt too long"
    assert error_message(422, b'{"error":"Input validation error","error_type":"validation"}') == \
        "HTTP 422: Input validation error"
    assert error_message(404, b'{"detail":"Not Found"}') == "HTTP 404: Not Found"
    assert error_message(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert error_message(500, b"") == "HTTP 500"


def test_request_bodies_and_urls() -> None:
    spec = RequestSpec(0, "batch", 10, 32, prompt="hello", priority=1)
    body = request_body(spec, "m", temperature=0.0, ignore_eos=True, include_usage=True, send_priority=True)
    assert body == {"model": "m", "max_tokens": 32, "temperature": 0.0, "stream": True, "prompt": "hello",
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": 32,
                    "priority": 1}
    chat = RequestSpec(0, "default", 10, 8, messages=[{"role": "user", "content": "x"}])
    body = request_body(chat, "m", temperature=0.5, ignore_eos=False, include_usage=False, send_priority=False)
    assert body == {"model": "m", "max_tokens": 8, "temperature": 0.5, "stream": True,
                    "messages": [{"role": "user", "content": "x"}]}
    assert api_root("http://h:1/v1/") == api_root("http://h:1") == "http://h:1"
    assert endpoint_url("http://h:1/v1", "chat") == "http://h:1/v1/chat/completions"


METRICS = """# HELP titan:num_requests_waiting Requests waiting.
# TYPE titan:num_requests_waiting gauge
titan:num_requests_waiting{model_name="m"} 3.0
titan:num_requests_running{model_name="m"} 2
titan:kv_cache_usage_perc{model_name="m"} 0.5
titan:num_preemptions_total{model_name="m",reason="a \\"quoted\\" label, with comma"} 4
titan:engine_step_seconds_bucket{le="0.01",model_name="m"} 10
titan:engine_step_seconds_bucket{le="0.1",model_name="m"} 12
titan:engine_step_seconds_bucket{le="+Inf",model_name="m"} 12
titan:engine_step_seconds_sum{model_name="m"} 0.3
titan:engine_step_seconds_count{model_name="m"} 12
python_gc_collections_total{generation="0"} 100.0
python_gc_collections_total{generation="2"} 3.0
garbage line that does not parse
vllm:num_requests_waiting 99 1700000000000
"""


def test_prometheus_text_parsing_and_reduction() -> None:
    samples = parse_prometheus_text(METRICS)
    preemptions = [s for s in samples if s.name == "titan:num_preemptions_total"][0]
    assert preemptions.labels == {"model_name": "m", "reason": 'a "quoted" label, with comma'}
    assert [s.value for s in samples if s.name == "vllm:num_requests_waiting"] == [99.0]  # timestamp ignored
    reducer = MetricsReducer()
    first = reducer.reduce(samples)
    assert reducer.prefix == "titan"  # titan: wins over vllm: when both appear
    assert first == {"waiting": 3.0, "running": 2.0, "kv_usage": 0.5, "preemptions": 4.0, "step_seconds_sum": 0.3,
                     "step_count": 12.0, "gc_collections": 103.0, "gc_gen2_collections": 3.0}
    later = METRICS.replace('le="0.1",model_name="m"} 12', 'le="0.1",model_name="m"} 15').replace(
        'le="+Inf",model_name="m"} 12', 'le="+Inf",model_name="m"} 15')
    assert reducer.reduce(parse_prometheus_text(later))["step_seconds_max"] == 0.1
    vllm = MetricsReducer()
    assert vllm.reduce(parse_prometheus_text('vllm:gpu_cache_usage_perc 87.5\n')) == {"kv_usage": 0.875}
    assert MetricsReducer().reduce(parse_prometheus_text("llamacpp:tokens 5\n")) == {}


def test_the_scrape_parses_only_the_families_it_reads() -> None:
    text = METRICS + ('# HELP titan:e2e_request_latency_seconds Unread.\n# TYPE titan:e2e_request_latency_seconds'
                      ' histogram\ntitan:e2e_request_latency_seconds_bucket{le="1.0"} 5\npython_info{v="3"} 1\n')
    kept = read_lines(text)
    assert "e2e_request_latency" not in kept and "python_info" not in kept and "garbage" not in kept
    assert "# TYPE titan:num_requests_waiting gauge" in kept
    assert read_lines(text, ("titan:num_requests_running",)) == 'titan:num_requests_running{model_name="m"} 2\n'
    later = text.replace('le="+Inf",model_name="m"} 12', 'le="+Inf",model_name="m"} 15')
    full, filtered = MetricsReducer(), MetricsReducer()
    for scrape in (text, later):  # two scrapes, so the histogram's max is read too
        assert filtered.reduce(parse_prometheus_text(read_lines(scrape))) == full.reduce(parse_prometheus_text(scrape))


def test_histogram_max_bound() -> None:
    previous = {0.01: 5.0, 0.1: 5.0, math.inf: 5.0}
    assert max_bound(previous, {0.01: 7.0, 0.1: 7.0, math.inf: 7.0}) == 0.01
    assert max_bound(previous, {0.01: 6.0, 0.1: 6.0, math.inf: 7.0}) == math.inf
    assert max_bound(previous, previous) is None
