"""Server pieces that need no model: request checks, error shapes, metrics, startup bookkeeping."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from titan.engine.outputs import RequestOutput
from titan.server.async_engine import AsyncEngine
from titan.server.chat_protocol import ChatCompletionRequest
from titan.server.errors import APIError, validation_error
from titan.server.metrics import ServerMetrics, one_two_five_buckets, power_of_two_buckets
from titan.server.protocol import CompletionRequest, check_context, check_model
from titan.server.serve import process_start_time
from titan.server.serving import choice_index, sse


def parse_error(schema: type, raw: str) -> APIError:
    with pytest.raises(ValidationError) as caught:
        schema.model_validate_json(raw)
    return validation_error(caught.value.errors())


def test_check_context_fills_and_rejects() -> None:
    assert check_context(10, None, 100) == 90
    assert check_context(10, None, 100, kv_cache_tokens=64) == 54  # the cache, where it is less
    assert check_context(80, None, 100, kv_cache_tokens=64) == 1  # the engine refuses the prompt
    assert check_context(10, 90, 100) == 90
    with pytest.raises(APIError) as too_long:
        check_context(100, 1, 100)
    assert too_long.value.status == 400 and too_long.value.param == "prompt" and "100 tokens" in str(too_long.value)
    with pytest.raises(APIError) as too_many:
        check_context(10, 91, 100, prompt_param="messages")
    message = too_many.value.message
    assert too_many.value.param == "max_tokens" and too_many.value.code == "context_length_exceeded"
    assert "101 tokens (10 in the prompt, 91 in the completion)" in message


def test_sampling_params_mapping_and_errors() -> None:
    request = CompletionRequest(prompt="x", max_tokens=5, temperature=0.5, top_k=-1, stop="END", seed=3, n=2,
                                repetition_penalty=1.1, min_tokens=2, ignore_eos=True)
    first, second = (request.sampling_params(5, 2, index) for index in range(2))
    assert (first.seed, second.seed) == (3, 4)  # each choice its own seeded stream
    assert first.stop == ["END"] and first.top_k == 0 and first.temperature == 0.5 and first.logprobs == 2
    assert first.repetition_penalty == 1.1 and first.min_tokens == 2 and first.ignore_eos
    assert CompletionRequest(prompt="x").sampling_params(16, None).temperature == 1.0  # OpenAI's default
    for field, value in (("top_p", 0.0), ("temperature", -0.1), ("presence_penalty", 3.0), ("min_p", 2.0)):
        with pytest.raises(APIError) as caught:
            CompletionRequest(prompt="x", **{field: value}).sampling_params(4, None)
        assert caught.value.status == 400 and caught.value.param == field
    with pytest.raises(APIError) as negative:
        CompletionRequest(prompt="x").sampling_params(-3, None)
    assert negative.value.param == "max_tokens"


def test_request_level_checks() -> None:
    with pytest.raises(APIError, match="n must be"):
        CompletionRequest(prompt="x", n=0).check()
    with pytest.raises(APIError, match="stream_options"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).check()
    CompletionRequest(prompt="x", echo=True, logprobs=1).check()  # scores the prompt
    CompletionRequest(prompt="x", echo=True, logprobs=1, stream=True).check()  # streamed: with the first token
    with pytest.raises(APIError, match="max_tokens"):
        CompletionRequest(prompt="x", max_tokens=0).check()
    with pytest.raises(APIError, match="top_logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).check()
    with pytest.raises(APIError) as unknown:
        check_model("other", ["mine"])
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    check_model(None, ["mine"])
    check_model("mine", ["mine"])


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ([], [[]], [""]):
        with pytest.raises(APIError):
            CompletionRequest(prompt=empty).prompts()


def test_chat_messages_flatten_text_parts() -> None:
    request = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None},
    ], max_tokens=3, max_completion_tokens=7, logprobs=True)
    assert request.template_messages() == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hello, world"},
                                           {"role": "assistant", "content": ""}]
    assert request.requested_max_tokens == 7 and request.num_logprobs == 0


def test_validation_errors_become_openai_400s() -> None:
    broken = parse_error(CompletionRequest, '{"prompt": ')
    assert broken.status == 400 and broken.code == "invalid_json" and broken.param is None
    wrong_type = parse_error(CompletionRequest, '{"prompt": 12}')
    assert wrong_type.param == "prompt" and wrong_type.code == "invalid_type"  # no union tags like "str"
    missing = parse_error(CompletionRequest, "{}")
    assert missing.param == "prompt" and missing.code == "missing_required_parameter"
    part = parse_error(ChatCompletionRequest, '{"messages": [{"role": "user", "content": [{"type": "image"}]}]}')
    assert part.param == "messages.0.content"
    assert part.body() == {"error": {"message": part.message, "type": "invalid_request_error",
                                     "param": "messages.0.content", "code": "invalid_type"}}


def test_sse_framing_and_choice_ids() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert choice_index("cmpl-abc-def-12") == 12


def test_bucket_helpers() -> None:
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert power_of_two_buckets(512)[-1] == 512 and power_of_two_buckets(300)[-1] == 512


def output(request_id: str, prompt: int, tokens: int, new: int, finished: bool = False,
           reason: str | None = None, stamps: dict[str, float] | None = None) -> RequestOutput:
    return RequestOutput(request_id=request_id, num_prompt_tokens=prompt, num_output_tokens=tokens,
                         new_token_ids=list(range(new)), new_text="", finished=finished,
                         finish_reason=reason, metrics=stamps or {})


def test_metrics_record_requests() -> None:
    metrics = ServerMetrics("tiny", max_model_len=1024, max_num_batched_tokens=256)
    stamps = {"arrival": 10.0, "first_scheduled": 10.02, "first_token": 10.1}
    metrics.record_output(output("a", 7, 1, 1, stamps=stamps), None, 10.1)
    metrics.record_output(output("a", 7, 2, 1, stamps=stamps), 10.1, 10.105)
    metrics.record_output(output("a", 7, 3, 1, True, "length", stamps | {"finished": 10.11}), 10.105, 10.11)
    metrics.record_step(0.004, 32)
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[key] = sample.value
    assert samples["titan:prompt_tokens_total"] == 7 and samples["titan:generation_tokens_total"] == 3
    assert samples["titan:request_success_total,finished_reason=length"] == 1
    assert samples["titan:inter_token_latency_seconds_count"] == 2
    assert samples["titan:inter_token_latency_seconds_bucket,le=0.005"] == 1  # the 5 ms gap, resolved
    assert samples["titan:time_to_first_token_seconds_bucket,le=0.09"] == 0
    assert samples["titan:time_to_first_token_seconds_bucket,le=0.1"] == 1
    assert samples["titan:request_queue_time_seconds_sum"] == pytest.approx(0.02)
    assert samples["titan:request_decode_time_seconds_sum"] == pytest.approx(0.01)
    assert samples["titan:request_generation_tokens_sum"] == 3
    assert samples["titan:iteration_tokens_total_sum"] == 32
    assert samples["titan:engine_step_seconds_bucket,le=0.004"] == 1


def test_process_start_time_is_in_the_past() -> None:
    started = process_start_time()
    assert time.time() - 24 * 3600 < started <= time.time()


def test_engine_load_failure_is_reported() -> None:
    def broken_factory():
        raise FileNotFoundError("no such model")

    async def run() -> AsyncEngine:
        engine = AsyncEngine(broken_factory)
        engine.start()
        await asyncio.wait_for(engine.done.wait(), 10)
        await engine.stop()
        return engine

    engine = asyncio.run(run())
    assert isinstance(engine.error, FileNotFoundError) and not engine.ready.is_set() and not engine.alive


def test_unknown_names_are_logged_once_and_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from titan.server import fields

    monkeypatch.setattr(fields, "_logged", set())
    with caplog.at_level("WARNING", logger="titan.server"):
        for _ in range(2):
            fields.check_extra_fields({f"field{i}": 1 for i in range(fields.MAX_LOGGED_NAMES + 50)})
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == fields.MAX_LOGGED_NAMES + 1  # each name once, then one word about the rest
    assert "no longer logged" in messages[-1] and len(fields._logged) == fields.MAX_LOGGED_NAMES + 1
