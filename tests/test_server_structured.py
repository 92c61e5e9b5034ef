"""Structured outputs, logit_bias, /tokenize and /detokenize, and no silent ignores, on a real server with
the official openai client. Outputs are checked against the schema with jsonschema."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from harness.server import ServerProcess

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "rainy"]}, "maxItems": 3},
        "mayor": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                  "required": ["name"], "additionalProperties": False},
    },
    "required": ["city", "population", "coastal", "tags", "mayor"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe the city of Paris as JSON."}]


@pytest.fixture(scope="module")
def server(api_server: ServerProcess) -> ServerProcess:
    return api_server


@pytest.fixture(scope="module")
def client(api_client: openai.OpenAI) -> openai.OpenAI:
    return api_client


def test_json_schema_streamed_and_not_with_n_2(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    whole = client.chat.completions.create(model=None, messages=ASK, max_tokens=120, n=2, temperature=0.8, seed=3,
                                           response_format=response_format)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)
    stream = client.chat.completions.create(model=None, messages=ASK, max_tokens=120, temperature=0,
                                            response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI, server: ServerProcess) -> None:
    obj = client.chat.completions.create(model=None, messages=ASK, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a small model may ramble inside the object until max_tokens; it is still an object so far
        assert obj.choices[0].message.content.startswith("{")
    regex = client.completions.create(model=None, prompt="My phone number is", max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)
    for field in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        choice = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Is it blue?"}],
                                                max_tokens=5, temperature=1.0, seed=7, extra_body=field)
        assert choice.choices[0].message.content in ("yes", "no", "maybe")
    grammar = client.completions.create(model=None, prompt="Answer:", max_tokens=8, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= "up" | "down"'})
    assert grammar.choices[0].text in ("up", "down")


def test_bad_or_conflicting_constraints_are_400s_and_the_server_keeps_serving(server: ServerProcess) -> None:
    url = server.url + "/v1/chat/completions"
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format"),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"logit_bias": {"42": 1000}}, "logit_bias"),
    ]
    for extra, param in cases:
        response = httpx.post(url, json={"messages": ASK, "max_tokens": 4, **extra}, timeout=120)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.text)
    ok = httpx.post(url, json={"messages": ASK, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, server: ServerProcess) -> None:
    paris = httpx.post(server.url + "/tokenize", json={"prompt": " Paris", "add_special_tokens": False},
                       timeout=30).json()["tokens"]
    assert len(paris) == 1
    plain = client.completions.create(model=None, prompt="The capital of France is", max_tokens=3, temperature=0)
    banned = client.completions.create(model=None, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={str(paris[0]): -100})
    forced = client.completions.create(model=None, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={str(paris[0]): 100})
    assert plain.choices[0].text.startswith(" Paris")
    assert "Paris" not in banned.choices[0].text
    assert forced.choices[0].text == " Paris" * 3
    # vLLM's allowed_token_ids: only those may be sampled (here, at a temperature that would wander).
    only = client.completions.create(model=None, prompt="Hello", max_tokens=3, temperature=1.5, seed=4,
                                     extra_body={"allowed_token_ids": paris})
    assert only.choices[0].text == " Paris" * 3


def test_continuous_usage_stats_in_every_chunk(server: ServerProcess) -> None:
    body = {"messages": ASK, "max_tokens": 6, "n": 2, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(server, "/v1/chat/completions", body)
    assert all(chunk["usage"] is not None for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12  # two choices of 6 tokens
    assert {chunk["usage"]["prompt_tokens"] for chunk in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    plain = sse_chunks(server, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    assert all(chunk["usage"] is None for chunk in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 12


def test_bad_words_are_never_written(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    first, second, third = plain.split()[:3]

    def written(*bad_words: str) -> str:
        reply = httpx.post(server.url + "/v1/completions", json=body | {"bad_words": list(bad_words)}, timeout=120)
        return reply.json()["choices"][0]["text"]

    word = first.strip(".,")  # greedy " Paris.\n\nThe answer is: ..."
    assert word not in written(word)
    # A word of several tokens: its first tokens may be written, its last one never right after them.
    phrase = f"{second} {third}"
    kept = plain[:plain.index(phrase) + len(second)]
    assert len(httpx.post(server.url + "/tokenize", json={"prompt": phrase, "add_special_tokens": False},
                          timeout=30).json()["tokens"]) > 1
    without = written(phrase)
    assert without.startswith(kept) and phrase not in without
    # Offline, vLLM's SamplingParams(bad_words=...) does the same (the engine tokenizes them).
    from titan import LLM
    from titan.engine.sampling_params import SamplingParams

    llm = LLM("default", max_num_seqs=1, kv_cache_memory=0.05)
    offline = llm.generate(body["prompt"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                          bad_words=[phrase]))[0].text
    assert offline == without
    for bad in (["x"] * 300, ["lighthouse keeper " * 40]):  # bounded in number and in length (every step checks)
        refused = httpx.post(server.url + "/v1/completions", json=body | {"bad_words": bad}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text


def test_return_tokens_as_token_ids(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    named = httpx.post(server.url + "/v1/completions", json=body | {"return_tokens_as_token_ids": True},
                       timeout=120).json()["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", token) for token in named["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", key) for top in named["top_logprobs"] for key in top)
    ids = [int(token.split(":")[1]) for token in named["tokens"]]
    texts = [httpx.post(server.url + "/detokenize", json={"tokens": [i]}, timeout=30).json()["prompt"] for i in ids]
    assert texts == plain["tokens"] and named["token_logprobs"] == pytest.approx(plain["token_logprobs"])
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": ASK, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert all(entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())
               for entry in content)


def test_return_token_ids_whole_and_streamed(server: ServerProcess) -> None:
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France is"},
                            timeout=30).json()["tokens"]
    # A stop string holds text back while its tokens are already generated: the ids must still all arrive.
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "n": 2, "stop": ["answer"],
            "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}, timeout=30).json()
        assert text["prompt"].startswith(choice["text"])  # the ids decode to the text (and its cut stop string)
    chunks = sse_chunks(server, "/v1/completions", body)
    for index in (0, 1):
        entries = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert entries[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in e for e in entries[1:])
        assert sum((e["token_ids"] for e in entries), []) == whole["choices"][index]["token_ids"]
    # Chat: the prompt's ids on the response (streamed: its first chunk), each choice's on the choice.
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": ASK}, timeout=30).json()["tokens"]
    chat_body = {"messages": ASK, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body, timeout=120).json()
    assert reply["prompt_token_ids"] == chat_ids and len(reply["choices"][0]["token_ids"]) == \
        reply["usage"]["completion_tokens"]
    streamed = sse_chunks(server, "/v1/chat/completions", chat_body)
    assert streamed[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in c for c in streamed[1:])
    assert sum((c["choices"][0]["token_ids"] for c in streamed if c["choices"]), []) == reply["choices"][0]["token_ids"]


def test_truncate_prompt_tokens_keeps_the_prompt_end(server: ServerProcess) -> None:
    prompt = "One two three four five six seven eight nine ten"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True}
    cut = httpx.post(server.url + "/v1/completions", json=body | {"truncate_prompt_tokens": 4}, timeout=120).json()
    whole = httpx.post(server.url + "/v1/completions", json=body | {"truncate_prompt_tokens": -1}, timeout=120).json()
    assert cut["usage"]["prompt_tokens"] == 4 and whole["usage"]["prompt_tokens"] == len(ids)
    tail = httpx.post(server.url + "/detokenize", json={"tokens": ids[-4:]}, timeout=30).json()["prompt"]
    assert cut["choices"][0]["text"].startswith(tail) and prompt.endswith(tail)  # echo shows what was kept
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1,
                                                                 "truncate_prompt_tokens": 3}, timeout=120).json()
    assert chat["usage"]["prompt_tokens"] == 3
    for bad, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
                       ({"allowed_token_ids": []}, "allowed_token_ids")):
        reply = httpx.post(server.url + "/v1/completions", json=body | bad, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_tokenize_and_detokenize_match_the_engine_tokenizer(server: ServerProcess) -> None:
    text = "Titan keeps the tail flat."
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True},
                           timeout=30).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()
    assert back["prompt"].endswith(text)
    chat = httpx.post(server.url + "/tokenize", json={"messages": ASK}, timeout=30).json()
    usage = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1},
                       timeout=120).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]  # the same tokens the chat endpoint feeds the model
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/completions", "suffix", " and then"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "chat_template", "{{ messages[0].content }}"),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "length_penalty", 0.5),
])
def test_known_fields_titan_cannot_honour_are_400_naming_them(server: ServerProcess, route: str, field: str,
                                                             value: object) -> None:
    body = {"messages": ASK} if "chat" in route else {"prompt": "Hi"}
    response = httpx.post(server.url + route, json={**body, "max_tokens": 2, field: value}, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                          "param": field, "code": "unsupported_parameter"}


def test_include_stop_str_in_output(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stop": ["."]}
    cut = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    kept = httpx.post(server.url + "/v1/completions", json=body | {"include_stop_str_in_output": True},
                      timeout=120).json()["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert "." not in cut["text"] and kept["text"] == cut["text"] + "."


def test_chat_template_fields_shape_the_prompt(server: ServerProcess) -> None:
    begun = ASK + [{"role": "assistant", "content": "Paris is the capital of"}]

    def tokens(body: dict) -> list[int]:
        reply = httpx.post(server.url + "/tokenize", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    def detokenize(ids: list[int]) -> str:
        return httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    # continue_final_message: the prompt ends inside the begun reply, not after its end-of-turn marker.
    continued = tokens({"messages": begun, "add_generation_prompt": False, "continue_final_message": True})
    closed = tokens({"messages": begun, "add_generation_prompt": False})
    assert detokenize(continued).endswith("<|im_start|>assistant\nParis is the capital of")
    assert closed[:len(continued)] == continued and detokenize(closed[len(continued):]).startswith("<|im_end|>")
    # add_generation_prompt false: the same conversation without the opened assistant turn.
    opened, plain = tokens({"messages": ASK}), tokens({"messages": ASK, "add_generation_prompt": False})
    assert opened[:len(plain)] == plain and detokenize(opened[len(plain):]) == "<|im_start|>assistant\n"
    # The chat endpoint feeds the model those very tokens, and the model goes on with the begun sentence.
    body = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
            "temperature": 0}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert reply["usage"]["prompt_tokens"] == len(continued)
    assert not reply["choices"][0]["message"]["content"].startswith("<|im_end|>")
    # vLLM's echo: the reply starts with the message it continues, whole or streamed.
    echoed = httpx.post(server.url + "/v1/chat/completions", json=body | {"echo": True}, timeout=120).json()
    continuation = reply["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Paris is the capital of" + continuation
    chunks = sse_chunks(server, "/v1/chat/completions", body | {"echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Paris is the capital of" + \
        continuation
    no_echo = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "temperature": 0,
                                                                    "echo": True}, timeout=120).json()
    assert not no_echo["choices"][0]["message"]["content"].startswith(ASK[0]["content"])  # a user turn is not echoed
    plain_reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1,
                                                                        "add_generation_prompt": False}, timeout=120)
    assert plain_reply.json()["usage"]["prompt_tokens"] == len(plain)
    # Completions honour add_special_tokens (this tokenizer adds no BOS, so both counts agree with /tokenize).
    for add in (True, False):
        counted = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                                   "add_special_tokens": add}, timeout=120).json()
        assert counted["usage"]["prompt_tokens"] == len(tokens({"prompt": "Hi", "add_special_tokens": add}))
    # chat_template_kwargs the template does not read change nothing and are logged once by name.
    for _ in range(2):
        assert tokens({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}) == opened
    assert server.log().count("chat_template_kwargs 'enable_thinking' is not read") == 1


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    ("/tokenize", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    ("/tokenize", {"chat_template": "{{ messages }}"}, "chat_template"),
    # Bad constraints: the GBNF converter's own error type once reached the client as a 500 (fuzzing found it).
    ("/v1/chat/completions", {"guided_grammar": "d\u009c\u00af"}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    # Known options inside objects, named by their path.
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "titan_x": True,
                                                                 "continuous_usage_stats": "often"}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+", "structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
])
def test_request_field_errors_name_the_field(server: ServerProcess, route: str, body: dict, param: str) -> None:
    base = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": ASK}
    reply = httpx.post(server.url + route, json=base | {"max_tokens": 1} | body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_served_and_logged_once(server: ServerProcess) -> None:
    for _ in range(2):
        response = httpx.post(server.url + "/v1/completions",
                              json={"prompt": "Hi", "max_tokens": 2, "frobnicate": True}, timeout=120)
        assert response.status_code == 200
    assert server.log().count("ignoring unknown request field 'frobnicate'") == 1
    nested = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True,
                                                             "stream_options": {"include_usage": True, "tempo": 1}},
                        timeout=120)
    assert nested.status_code == 200 and '"usage":{"prompt_tokens"' in nested.text
    assert server.log().count("ignoring unknown request field 'stream_options.tempo'") == 1


def test_echo_with_logprobs_scores_the_prompt_like_teacher_forcing(server: ServerProcess) -> None:
    from titan import LLM
    from titan.engine.sampling_params import SamplingParams
    from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    assert choice["text"].endswith(prompt) and reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                                  "total_tokens": len(ids),
                                                                  "prompt_tokens_details": {"cached_tokens": 0}}
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])
    # The engine, offline, one teacher-forced pass over the prompt.
    llm = LLM("default", max_num_seqs=1, kv_cache_memory=0.05)
    step = ScheduledSequence(seq_id=0, token_ids=ids, start_position=0, block_table=list(range(len(ids) // 16 + 1)),
                             sample=True, sampling_params=SamplingParams(), prompt_token_ids=ids, output_token_ids=[])
    reference = llm.engine.runner.compute_logits_for(SchedulerOutput(scheduled=[step]), all_tokens=True)
    expected = reference.log_softmax(-1)
    for position in range(1, len(ids)):
        assert logprobs["token_logprobs"][position] == pytest.approx(float(expected[position - 1, ids[position]]),
                                                                     abs=2e-3)
    # With generated tokens too: the prompt's entries come first, then the completion's.
    more = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 3}, timeout=120).json()
    assert len(more["choices"][0]["logprobs"]["tokens"]) == len(ids) + 3
    scored = more["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[0] is None and scored[1:len(ids)] == pytest.approx(logprobs["token_logprobs"][1:], abs=2e-3)


def test_vllm_prompt_logprobs_field(server: ServerProcess) -> None:
    reply = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": ASK, "max_tokens": 2, "prompt_logprobs": 1}, timeout=120).json()
    entries = reply["choices"][0]["prompt_logprobs"]
    assert len(entries) == reply["usage"]["prompt_tokens"] and entries[0] is None
    assert all(entry and all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())
               for entry in entries[1:])
    # The same on /v1/completions, without `logprobs`: entries still name their tokens' text.
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "The capital of France", "max_tokens": 1,
                                                             "prompt_logprobs": 0}, timeout=120).json()
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France"},
                            timeout=30).json()["tokens"]
    entries = plain["choices"][0]["prompt_logprobs"]
    assert plain["choices"][0]["logprobs"] is None and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        token = entry[str(prompt_ids[position])]
        assert token["decoded_token"] == httpx.post(server.url + "/detokenize", json={"tokens": [prompt_ids[position]]},
                                                    timeout=30).json()["prompt"]


def sse_chunks(server: ServerProcess, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body | {"stream": True}, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_prompt_logprobs_stream_with_the_first_token(server: ServerProcess) -> None:
    # echo + logprobs, streamed: the prompt's text and logprobs arrive in the first chunk, and the chunks
    # add up to the whole response.
    body = {"prompt": "The capital of France is", "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]
    chunks = [chunk["choices"][0] for chunk in sse_chunks(server, "/v1/completions", body) if chunk["choices"]]
    assert chunks[0]["text"].startswith("The capital of France is")
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    for key in ("tokens", "text_offset"):
        assert [item for chunk in chunks if chunk["logprobs"] for item in chunk["logprobs"][key]] == \
            whole["logprobs"][key]
    streamed = [item for chunk in chunks if chunk["logprobs"] for item in chunk["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=2e-3)
    # max_tokens 0 streamed: the prompt scored, nothing generated shown.
    scored = [chunk["choices"][0] for chunk in sse_chunks(server, "/v1/completions", body | {"max_tokens": 0})
              if chunk["choices"]]
    assert "".join(chunk["text"] for chunk in scored) == "The capital of France is"
    # vLLM's prompt_logprobs field rides on each choice's first chunk, chat and completions alike.
    chat = {"messages": ASK, "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0, "n": 2}
    expected = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=300).json()
    carried = {}
    for chunk in sse_chunks(server, "/v1/chat/completions", chat):
        for choice in chunk["choices"]:
            if "prompt_logprobs" in choice:
                assert choice["index"] not in carried
                carried[choice["index"]] = choice["prompt_logprobs"]
    assert sorted(carried) == [0, 1]
    reference = expected["choices"][0]["prompt_logprobs"]
    for entries in carried.values():
        assert len(entries) == len(reference) and entries[0] is None
        assert [sorted(entry) for entry in entries[1:]] == [sorted(entry) for entry in reference[1:]]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: list) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_always_parse(client: openai.OpenAI) -> None:
    # Parallel calls: a JSON array of at most 8 calls, so even a model that repeats itself closes it.
    required = client.chat.completions.create(model=None, messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=400, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(model=None, messages=WEATHER_ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    check_calls(calls)
    assert [call.function.name for call in calls] == ["get_time"]
    single = client.chat.completions.create(model=None, messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, temperature=0.9, seed=2)
    assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_arrive_in_openai_chunks(client: openai.OpenAI) -> None:
    ask = {"model": None, "messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": "required",
           "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}
    stream = client.chat.completions.create(**ask, stream=True)
    names, ids, arguments, fragments, reasons = {}, {}, {}, {}, []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.index not in names:  # the first delta of a call announces it whole
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    names[delta.index], ids[delta.index] = delta.function.name, delta.id
                else:
                    assert delta.function.name is None and delta.id in (None, ids[delta.index])
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
                fragments[delta.index] = fragments.get(delta.index, 0) + bool(delta.function.arguments)
    assert reasons[-1] == "tool_calls" and names
    for index, name in names.items():
        jsonschema.validate(json.loads(arguments[index]), SCHEMAS[name])
        assert fragments[index] > 1, "the arguments came whole, not as the model wrote them"
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [call.function.name for call in whole] == [names[index] for index in sorted(names)]
    assert [json.loads(call.function.arguments) for call in whole] == [
        json.loads(arguments[index]) for index in sorted(names)]


def test_a_forced_call_cut_by_max_tokens_is_the_same_call_streamed_or_whole(client: openai.OpenAI) -> None:
    """Whole, the cut call came back as its raw JSON in `content`; streamed, as a call with the arguments so far."""
    ask = {"model": None, "messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 12, "temperature": 0,
           "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole = client.chat.completions.create(**ask).choices[0]
    streamed, reasons = {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                name, arguments = streamed.get(delta.index, (delta.function.name, ""))
                streamed[delta.index] = (name, arguments + (delta.function.arguments or ""))
    assert whole.finish_reason == reasons[-1] == "length" and whole.message.content is None
    assert [(call.function.name, call.function.arguments) for call in whole.message.tool_calls] == [
        streamed[index] for index in sorted(streamed)]


def test_auto_and_a_multi_turn_conversation_with_a_tool_result(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(model=None, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60, temperature=0)
    message = auto.choices[0].message
    if message.tool_calls:  # whatever the model chose, the response is consistent with it
        assert auto.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert auto.choices[0].finish_reason in ("stop", "length") and message.content
    history = [*WEATHER_ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=None, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=24, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_tool_choice_errors(server: ServerProcess) -> None:
    url = server.url + "/v1/chat/completions"
    cases = [({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice")]
    for extra, param in cases:
        response = httpx.post(url, json={"messages": WEATHER_ASK, "max_tokens": 4, **extra}, timeout=120)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
