"""Routing policies without servers: consistent hashing, bounded loads, power of two choices, round-robin,
affinity keys and the router's settings."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from titan.router.backend import Backend, BackendPool
from titan.router.config import BackendSpec, ConfigError, build_config, load_yaml, parse_backend
from titan.router.hash_ring import HashRing
from titan.router.health import load_gauges
from titan.router.policies import LeastLoad, PrefixAffinity, RoundRobin, bounded_limit
from titan.router.request_key import RoutingInfo, affinity_key, routing_info

NAMES = ["titan-0", "titan-1", "titan-2"]
KEYS = [f"key-{i}".encode() for i in range(3000)]


def backends(names: list[str] = NAMES) -> list[Backend]:
    return [Backend(f"http://{name}:8000", name, index, ready=True) for index, name in enumerate(names)]


# ---- consistent hashing ----------------------------------------------------------------------------

def test_ring_is_stable_and_spreads_keys_evenly() -> None:
    ring = HashRing(NAMES)
    owners = [ring.owner(key) for key in KEYS]
    assert owners == [HashRing(list(reversed(NAMES))).owner(key) for key in KEYS]  # order of listing irrelevant
    counts = collections.Counter(owners)
    assert set(counts) == set(NAMES)
    for name in NAMES:  # 160 points each: every backend within ±25 % of its fair third
        assert 0.75 * len(KEYS) / 3 < counts[name] < 1.25 * len(KEYS) / 3, counts


def test_ring_walk_visits_every_backend_once_owner_first() -> None:
    ring = HashRing(NAMES)
    for key in KEYS[:50]:
        walk = list(ring.walk(key))
        assert sorted(walk) == sorted(NAMES) and walk[0] == ring.owner(key)


def test_removing_a_backend_moves_only_its_keys() -> None:
    policy = PrefixAffinity(NAMES)
    everyone = backends()
    before = {key: policy.choose(everyone, key).name for key in KEYS}
    survivors = [backend for backend in everyone if backend.name != "titan-1"]
    after = {key: policy.choose(survivors, key).name for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(before[key] == "titan-1" for key in moved)
    assert len(moved) == sum(1 for key in KEYS if before[key] == "titan-1")
    # ... and back when it rejoins.
    assert {key: policy.choose(everyone, key).name for key in KEYS} == before


def test_adding_a_backend_moves_about_a_quarter_all_to_the_newcomer() -> None:
    before = HashRing(NAMES)
    after = HashRing([*NAMES, "titan-3"])
    moved = [key for key in KEYS if before.owner(key) != after.owner(key)]
    assert all(after.owner(key) == "titan-3" for key in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.35


# ---- bounded loads ---------------------------------------------------------------------------------

def test_bounded_limit() -> None:
    assert bounded_limit(0, 3, 1.25, 1) == 1
    assert bounded_limit(11, 3, 1.25, 1) == 5  # ceil(1.25 * 12 / 3)
    assert bounded_limit(11, 3, 1.25, 8) == 8  # min_load wins at low load
    assert bounded_limit(99, 4, 1.5, 4) == 38  # ceil(1.5 * 100 / 4)


@pytest.mark.parametrize("load_factor,min_load", [(1.25, 4), (1.25, 1), (2.0, 2)])
def test_a_hot_prefix_cannot_overload_one_backend(load_factor: float, min_load: int) -> None:
    policy = PrefixAffinity(NAMES, load_factor, min_load)
    pool = backends()
    hot = b"the same system prompt"
    home = policy.choose(pool, hot)
    placed = []
    for _ in range(60):  # 60 concurrent requests with one key, none finishing
        chosen = policy.choose(pool, hot)
        placed.append(chosen.name)
        total = sum(backend.outstanding for backend in pool)
        assert chosen.outstanding < bounded_limit(total, len(pool), load_factor, min_load)
        chosen.outstanding += 1
    # The key's home takes the first min_load, then the load spreads; no backend exceeds the bound.
    assert placed[:min_load] == [home.name] * min_load
    fair = 60 / len(pool)
    assert max(backend.outstanding for backend in pool) <= max(load_factor * fair + 1, min_load)
    if load_factor * 2 < len(pool):  # two backends at the bound cannot hold everything: the third gets some
        assert all(backend.outstanding > 0 for backend in pool)


def test_spilled_keys_return_home_when_load_falls() -> None:
    policy = PrefixAffinity(NAMES, 1.25, 2)
    pool = backends()
    key = b"a prefix"
    home = policy.choose(pool, key)
    home.outstanding = 10
    assert policy.choose(pool, key) is not home
    home.outstanding = 0
    assert policy.choose(pool, key) is home


def test_prefix_affinity_without_key_balances_by_load() -> None:
    policy = PrefixAffinity(NAMES, seed=1)
    pool = backends()
    pool[0].outstanding, pool[1].outstanding, pool[2].outstanding = 9, 9, 0
    picks = collections.Counter(policy.choose(pool, None).name for _ in range(200))
    assert picks["titan-2"] > 120  # power of two choices: picked whenever sampled (2/3 of the time)


# ---- power of two choices ---------------------------------------------------------------------------

def test_least_load_never_picks_the_most_loaded_and_favours_the_least() -> None:
    names = [f"b{i}" for i in range(5)]
    pool = backends(names)
    for backend, load in zip(pool, [0, 2, 4, 6, 8], strict=True):
        backend.outstanding = load
    policy = LeastLoad(seed=7)
    picks = collections.Counter(policy.choose(pool, None).name for _ in range(5000))
    assert picks["b4"] == 0  # it loses every pairing
    # b0 wins whenever it is sampled: 1 - C(4,2)/C(5,2) = 2/5 of draws; b3 only against b4: 1/10.
    assert picks["b0"] / 5000 == pytest.approx(0.4, abs=0.03)
    assert picks["b3"] / 5000 == pytest.approx(0.1, abs=0.02)


def test_least_load_counts_scraped_queue_and_kv_usage() -> None:
    pool = backends(["a", "b"])
    policy = LeastLoad(seed=0)
    pool[0].waiting = 5.0  # the backend's own queue (e.g. other routers' requests)
    assert all(policy.choose(pool, None).name == "b" for _ in range(20))
    pool[0].waiting, pool[1].kv_cache_usage = 0.0, 0.9
    assert all(policy.choose(pool, None).name == "a" for _ in range(20))


# ---- round-robin and the pool ------------------------------------------------------------------------

def test_round_robin_cycles_and_skips_backends_out_of_the_pool() -> None:
    pool = BackendPool([BackendSpec(f"http://{name}", name) for name in NAMES], RoundRobin())
    for backend in pool.backends:
        backend.ready = True
    assert [pool.choose(RoutingInfo(), set()).name for _ in range(6)] == NAMES * 2
    pool.set_ready(pool.backends[1], False, "draining")
    assert [pool.choose(RoutingInfo(), set()).name for _ in range(4)] == ["titan-0", "titan-2"] * 2
    assert pool.choose(RoutingInfo(), {"titan-0"}).name == "titan-2"  # a retry never goes back
    assert pool.choose(RoutingInfo(), {"titan-0", "titan-2"}) is None


def test_pool_routes_by_model_when_backends_list_theirs() -> None:
    pool = BackendPool([BackendSpec(f"http://{name}", name) for name in NAMES], RoundRobin())
    for backend, models in zip(pool.backends, [{"small"}, {"large"}, None], strict=True):
        backend.ready = True
        backend.models = frozenset(models) if models is not None else None  # None: could not tell
    picks = {pool.choose(RoutingInfo(model="large"), set()).name for _ in range(6)}
    assert picks == {"titan-1", "titan-2"}
    # A model nobody lists goes where it might be served; if nowhere, anywhere (the backend answers 404).
    assert {pool.choose(RoutingInfo(model="other"), set()).name for _ in range(6)} == {"titan-2"}
    pool.backends[2].models = frozenset({"small"})
    assert {pool.choose(RoutingInfo(model="other"), set()).name for _ in range(6)} == set(NAMES)


# ---- affinity keys -----------------------------------------------------------------------------------

SYSTEM = "You are a careful assistant for a hardware store. " * 8  # 400 characters


def test_completion_prompts_sharing_the_window_share_a_key() -> None:
    def key(prompt: object) -> bytes | None:
        return routing_info("/v1/completions", json_bytes({"model": "m", "prompt": prompt}), 256, 64).key

    assert key(SYSTEM + "Where are the nails?") == key(SYSTEM + "Do you sell paint?")
    assert key(SYSTEM + "x") == key([SYSTEM + "y", "another prompt of the batch"])
    assert key("Where are the nails?") != key("Do you sell paint?")
    assert key([1, 2, 3]) == key([[1, 2, 3]]) and key([1, 2, 3]) != key([1, 2, 4])
    assert key("") is None and key(None) is None


def test_chat_key_starts_with_the_system_message() -> None:
    def key(messages: list[dict[str, object]]) -> bytes | None:
        return routing_info("/v1/chat/completions", json_bytes({"messages": messages}), 256, 64).key

    system = {"role": "system", "content": SYSTEM}
    assert key([system, {"role": "user", "content": "nails?"}]) == key([system, {"role": "user", "content": "paint"}])
    parts = {"role": "system", "content": [{"type": "text", "text": SYSTEM}]}
    assert key([parts, {"role": "user", "content": "nails?"}]) == key([system, {"role": "user", "content": "x"}])
    other = {"role": "system", "content": "You are a poet. " * 30}
    assert key([other, {"role": "user", "content": "nails?"}]) != key([system, {"role": "user", "content": "x"}])


def test_responses_api_keys_like_the_same_chat() -> None:
    def chat(messages: list[dict[str, object]]) -> bytes | None:
        return routing_info("/v1/chat/completions", json_bytes({"messages": messages}), 256, 64).key

    def responses(body: dict[str, object]) -> bytes | None:
        return routing_info("/v1/responses", json_bytes(body), 256, 64).key

    system = {"role": "system", "content": SYSTEM}
    same = chat([system, {"role": "user", "content": "nails?"}])
    assert responses({"instructions": SYSTEM, "input": "nails?"}) == same
    assert responses({"instructions": SYSTEM, "input": [{"role": "user", "content": "nails?"}]}) == same
    assert responses({"input": "You are a poet. " * 30}) != same and responses({"input": 3}) is None


def test_key_covers_whole_chunks_only() -> None:
    text = "".join(random.Random(0).choice("abcdefgh") for _ in range(300))
    assert affinity_key(text[:200], 256, 64) == affinity_key(text[:192], 256, 64)  # 3 whole chunks
    assert affinity_key(text[:200], 256, 64) != affinity_key(text[:128], 256, 64)
    assert affinity_key(text, 256, 64) == affinity_key(text[:256] + "anything else", 256, 64)
    assert affinity_key("short", 256, 64) == affinity_key("short", 256, 64) != affinity_key("shore", 256, 64)


def test_routing_info_tolerates_any_body() -> None:
    for body in (b"", b"not json", b"[1, 2]", b'{"prompt": {"odd": 1}}', b"\xff\xfe"):
        assert routing_info("/v1/completions", body, 256, 64).key is None
    assert routing_info("/v1/embeddings", json_bytes({"input": SYSTEM, "model": "m"}), 256, 64) == RoutingInfo("m")


def json_bytes(payload: object) -> bytes:
    import json

    return json.dumps(payload).encode()


# ---- load gauges ---------------------------------------------------------------------------------------

def test_load_gauges_read_titan_and_vllm_names() -> None:
    titan = ('# HELP titan:num_requests_waiting x\ntitan:num_requests_waiting{model_name="a"} 3.0\n'
             'titan:kv_cache_usage_perc{model_name="a"} 0.25\ntitan:num_requests_running{model_name="a"} 9\n')
    assert load_gauges(titan) == (3.0, 0.25)
    vllm = ('vllm:num_requests_waiting{engine="0",model_name="m"} 2\nvllm:num_requests_waiting{engine="1",'
            'model_name="m"} 1\nvllm:gpu_cache_usage_perc{engine="0"} 0.5\nvllm:gpu_cache_usage_perc{engine="1"} 0.7\n')
    assert load_gauges(vllm) == (3.0, 0.7)
    assert load_gauges("other_metric 1\n") == (None, None)


# ---- settings --------------------------------------------------------------------------------------------

def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policy: least-load\nport: 9000\nprefix_chars: 512\nbackends:\n"
                    "  - http://10.0.0.1:8000/v1\n  - {url: 'http://10.0.0.2:8000/', name: second}\n")
    config = build_config(load_yaml(path), {"port": 9100, "policy": None, "backends": None})
    assert (config.policy, config.port, config.prefix_chars) == ("least-load", 9100, 512)
    assert config.backends == [BackendSpec("http://10.0.0.1:8000", "10.0.0.1:8000"),
                               BackendSpec("http://10.0.0.2:8000", "second")]
    replaced = build_config(load_yaml(path), {"backends": ["localhost:8001"]})
    assert replaced.backends == [BackendSpec("http://localhost:8001", "localhost:8001")]


@pytest.mark.parametrize("settings,message", [
    ({}, "no backends"),
    ({"backends": ["http://a:1", "http://a:1"]}, "unique"),
    ({"backends": ["http://a:1"], "policy": "random"}, "unknown policy"),
    ({"backends": ["http://a:1"], "polcy": "round-robin"}, "unknown settings"),
    ({"backends": ["http://a:1"], "load_factor": 0.5}, "load_factor"),
    ({"backends": ["http://a:1"], "chunk_chars": 512}, "chunk_chars"),
    ({"backends": ["ftp://a:1"]}, "http"),
    ({"backends": ["http://a:1"], "port": "eighty"}, "integer"),
    ({"backends": ["http://a:1"], "port": 80.5}, "integer"),
    ({"backends": ["http://a:1"], "health_interval": "often"}, "number"),
    ({"backends": ["http://a:1"], "access_log": "yes"}, "true or false"),
    ({"backends": ["http://a:1"], "host": 5}, "str"),
    ({"backends": "http://a:1"}, "list"),
])
def test_bad_settings_are_rejected(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(settings, {})


def test_parse_backend_names() -> None:
    assert parse_backend("http://titan-0.titan:8000/").name == "titan-0.titan:8000"
    assert parse_backend({"url": "https://example.com/v1", "name": "remote"}) == BackendSpec(
        "https://example.com", "remote")
