"""The score policy on real pool objects: block hashing, cache-aware choice, spreading, forgetting."""

from __future__ import annotations

import pytest

from titan.router.backend import Backend, BackendPool
from titan.router.config import BackendSpec, ConfigError, RouterConfig
from titan.router.request_key import RoutingInfo, block_hashes, routing_info
from titan.router.scoring import BlockTable, ScorePolicy, ScoreWeights
from titan.router.step_cost import StepCost, StepTotals, step_totals

CHUNK = 64


def info(text: str) -> RoutingInfo:
    return RoutingInfo(key=None, blocks=block_hashes(text, CHUNK, 16384), prompt_chars=len(text))


def prefix(number: int) -> str:
    return f"Application {number}. " + " ".join(f"word{number}x{i}" for i in range(300)) + " "


def backends(count: int) -> list[Backend]:
    return [Backend(f"http://b{i}", f"b{i}", i, ready=True, seconds_per_token=0.002) for i in range(count)]


def test_block_hashes_are_chained() -> None:
    shared = "x" * (CHUNK * 3)
    first = block_hashes(shared + "a" * CHUNK, CHUNK, 10_000)
    second = block_hashes(shared + "b" * CHUNK, CHUNK, 10_000)
    assert first[:3] == second[:3] and first[3] != second[3]
    # A block's hash depends on everything before it: the same chunk after a different start differs.
    assert block_hashes("y" * CHUNK + "a" * CHUNK, CHUNK, 10_000)[1] != first[3]
    assert len(block_hashes("z" * (CHUNK * 10), CHUNK, CHUNK * 4)) == 4  # bounded by max_chars
    assert block_hashes("short", CHUNK, 10_000) == ()
    routed = routing_info("/v1/completions", b'{"prompt": "' + b"q" * 200 + b'"}', 256, CHUNK, 16384)
    assert len(routed.blocks) == 3 and routed.prompt_chars == 200


def test_block_table_is_bounded_and_counts_leading_hits() -> None:
    table = BlockTable(capacity=4)
    blocks = block_hashes(prefix(1), CHUNK, 16384)
    table.record(blocks[:3])
    assert table.leading_hits(blocks) == 3
    table.record(blocks[10:13])
    assert len(table.blocks) == 4 and table.leading_hits(blocks) == 0  # the oldest were dropped


def test_a_repeated_prefix_goes_where_it_is_cached() -> None:
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=1000, chunk_chars=CHUNK)
    pool = backends(3)
    first = policy.choose_for(pool, info(prefix(1) + "Question 1?"))
    # Whatever the others' state, a second request with the same prefix lands there.
    again = policy.choose_for(pool, info(prefix(1) + "Question 2?"))
    assert again is first
    assert policy.last[first.name] == max(policy.last.values())


def test_distinct_prefixes_spread_over_the_replicas() -> None:
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=1000, chunk_chars=CHUNK)
    pool = backends(3)
    chosen = []
    for number in range(3):
        backend = policy.choose_for(pool, info(prefix(number) + "Question?"))
        backend.outstanding += 1  # as the proxy does while the request is open
        chosen.append(backend.name)
    assert sorted(chosen) == ["b0", "b1", "b2"]


def test_cold_prompts_spread_over_idle_replicas_not_yet_fitted() -> None:
    # One replica has served and has fitted step costs; the two idle ones have none yet. Each cold prompt
    # arrives after the last one finished (nothing outstanding anywhere): priced like their fitted peer, the
    # idle replicas get their turn instead of every cold prompt going to the one that happened to serve.
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=1000, chunk_chars=CHUNK)
    pool = [Backend(f"http://b{i}", f"b{i}", i, ready=True) for i in range(3)]
    pool[0].seconds_per_token, pool[0].step_overhead = 0.0018, 0.01
    chosen = {policy.choose_for(pool, info(prefix(number) + "Question?")).name for number in range(3)}
    assert chosen == {"b0", "b1", "b2"}
    assert len(set(policy.last.values())) == 1  # the last choice was a tie between equals


def test_a_hot_replica_sheds_its_prefix_to_an_idle_one() -> None:
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=10_000, chunk_chars=CHUNK)
    pool = backends(2)
    home = policy.choose_for(pool, info(prefix(7) + "first"))
    home.outstanding = 20
    for number in range(20):  # a pile of cold prompts queued on the same replica
        policy.choose_for([home], info(prefix(100 + number)))
    other = policy.choose_for(pool, info(prefix(7) + "second"))
    assert other is not home


def test_late_first_tokens_stretch_a_backends_predictions() -> None:
    # One replica's streams answer 4x later than its step costs predict (a busy host): its predictions
    # follow, so a cold prompt goes to the replica that will really start it sooner, and a queue of
    # prefill there lasts as long as it really does.
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=1000, chunk_chars=CHUNK)
    slow, quick = backends(2)
    cold = info(prefix(7) + "Question?")
    base, _ = policy.predicted_ttft(slow, cold, 0.0)
    for _ in range(12):
        predicted, _ = policy.predicted_ttft(slow, cold, 0.0)
        slow.first_token(predicted, 4 * base)
    assert slow.ttft_calibration == pytest.approx(4.0, rel=0.02)
    assert policy.predicted_ttft(slow, cold, 0.0)[0] == pytest.approx(4 * base, rel=0.02)
    chosen = policy.choose_for([slow, quick], cold)
    assert chosen is quick and policy.last_prediction == pytest.approx(base)
    for _ in range(30):  # bounded both ways, one observation moving it at most sqrt(2)
        quick.first_token(1.0, 1e6)
    assert quick.ttft_calibration == 20.0
    quick.first_token(1.0, 0.0)
    assert quick.ttft_calibration == pytest.approx(20.0 / 2**0.5)


def test_a_backend_with_no_first_token_yet_is_priced_like_its_peers() -> None:
    # The replica that served first answered sooner than its step costs said (a factor below 1). A replica
    # none of whose first tokens was seen is priced with its peers' factor, so a new prefix ties and goes
    # round the pool instead of piling onto the replica that happened to serve first.
    policy = ScorePolicy(ScoreWeights(), blocks_per_backend=1000, chunk_chars=CHUNK)
    served, idle = backends(2)
    for _ in range(4):
        served.first_token(1.0, 0.6)
    assert served.ttft_calibration < 0.5 and served.ttft_observations == 4 and idle.ttft_observations == 0
    cold = info(prefix(8) + "Question?")
    policy.next_index = 1  # backend 0 took the last request: ties go to backend 1
    assert policy.choose_for([served, idle], cold) is idle
    assert policy.last[served.name] == pytest.approx(policy.last[idle.name])
    # Once the idle one answered as its step costs said, its own factor counts: the served one looks faster.
    idle.first_token(1.0, 1.0)
    policy.next_index = 1
    assert policy.choose_for([served, idle], info(prefix(9) + "Question?")) is served


def test_a_backend_that_leaves_the_pool_is_forgotten() -> None:
    policy = ScorePolicy(ScoreWeights(prefix=5.0), blocks_per_backend=1000, chunk_chars=CHUNK)
    pool = BackendPool([BackendSpec("http://a", "a"), BackendSpec("http://b", "b")], policy)
    for backend in pool.backends:
        pool.set_ready(backend, True)
    home = pool.choose(info(prefix(3)), set())
    assert home is not None and home.name in policy.tables
    pool.set_ready(home, False, "restarted")
    assert home.name not in policy.tables


def test_step_cost_separates_step_overhead_from_token_cost() -> None:
    text = ('titan:engine_step_seconds_sum{model_name="m"} 2.0\n'
            'titan:engine_step_seconds_count{model_name="m"} 10.0\n'
            'titan:iteration_tokens_total_sum{model_name="m"} 1000.0\n')
    assert step_totals(text) == StepTotals(2.0, 10.0, 1000.0)
    assert step_totals("other 1\n") is None
    cost = StepCost()
    totals = StepTotals(0.0, 0.0, 0.0)
    cost.update(totals)
    # Steps cost 20 ms each plus 1 ms per token: decode-heavy and prefill-heavy intervals.
    for steps, tokens in ((50, 60), (5, 600), (20, 100), (8, 900)):
        totals = StepTotals(totals.seconds + 0.02 * steps + 0.001 * tokens, totals.steps + steps,
                            totals.tokens + tokens)
        cost.update(totals)
    assert cost.overhead == pytest.approx(0.02) and cost.per_token == pytest.approx(0.001)
    cost.update(StepTotals(0.1, 1.0, 10.0))  # counters went back: the backend restarted
    assert cost.overhead is None and cost.per_token is None


def test_score_is_the_default_and_its_settings_are_checked() -> None:
    assert RouterConfig().policy == "score"
    with pytest.raises(ConfigError, match="weights"):
        RouterConfig(backends=[BackendSpec("http://a", "a")], score_ttft_weight=-1).validate()
    with pytest.raises(ConfigError, match="score_prefix_chars"):
        RouterConfig(backends=[BackendSpec("http://a", "a")], score_prefix_chars=10).validate()
