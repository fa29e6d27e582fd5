"""The router's routing policies (router/routing.py) on worker pools with hand-set loads: prefix affinity, the
balance and cache thresholds, aging, dead workers, round robin, and a conversation's next turn."""

import socket

import pytest

from router import routing
from router.routing import BLOCK_SIZE, PrefixIndex, Route, RoutingConfig
from router.workers import Worker, WorkerPool
from tandem.rpc import common_pb2


def pool(role, policy="cache_aware", **cfg):
    p = WorkerPool(role, ["unused:1"], None, routing=RoutingConfig(policy, **cfg))
    p.workers = {}
    return p


def add(p, name, **load):
    load.setdefault("total_kv_tokens", 1 << 14)
    load.setdefault("free_kv_tokens", load["total_kv_tokens"])
    load.setdefault("free_state_slots", 8)
    load.setdefault("total_state_slots", 8)
    load.setdefault("free_kv_blocks", 100)
    load.setdefault("total_kv_blocks", 100)
    p.workers[name] = Worker(name, p.role, stub=None, channel=None, healthy=True, load=common_pb2.Load(**load))
    return p.workers[name]


def prompt(seed, n):
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


SYSTEM = prompt(1, 20 * BLOCK_SIZE)  # a shared 320-token prefix


def first(p, tokens, lease=0):
    route = Route(tokens)
    ws = p.candidates(lease, route)
    return ws[0].address, route.reason(p.role, ws[0].address)


def test_shared_prefix_goes_where_it_was_sent_until_that_worker_is_overloaded():
    p = pool("prefill")
    a, b = add(p, "a", queued_prompt_tokens=1000), add(p, "b")
    assert first(p, SYSTEM + [1, 2, 3]) == ("b", "least_loaded")  # nothing cached anywhere: by load
    p.placed(a, Route(SYSTEM + [1, 2, 3]))
    assert first(p, SYSTEM + [4, 5, 6, 7]) == ("a", "prefix_hit")  # 1000 queued tokens more than b: fine
    # imbalanced only when both thresholds are passed: more than 4096 tokens and 1.5 times the least loaded's
    for load_a, load_b, where in ((9000, 4000, "b"), (12000, 9000, "a"), (20000, 14000, "a"), (4096, 0, "a"),
                                  (4097, 0, "b")):
        a.load.queued_prompt_tokens, b.load.queued_prompt_tokens = load_a, load_b
        assert first(p, SYSTEM + [4, 5])[0] == where, (load_a, load_b)
    # the router's own prompts in flight count as queued: a burst tips the balance before the next poll
    a.load.queued_prompt_tokens = b.load.queued_prompt_tokens = 0
    a.inflight_prompt_tokens = 5000
    assert first(p, SYSTEM + [4, 5]) == ("b", "least_loaded")


def test_longest_expected_hit_wins_and_short_hits_go_by_load():
    p = pool("prefill")
    a, b = add(p, "a"), add(p, "b")
    add(p, "c", queued_prompt_tokens=10)
    p.placed(a, Route(SYSTEM[: 8 * BLOCK_SIZE] + prompt(2, 100)))  # shares 8 blocks with SYSTEM
    p.placed(b, Route(SYSTEM[: 15 * BLOCK_SIZE] + prompt(3, 100)))  # shares 15
    assert first(p, SYSTEM + prompt(4, 40)) == ("b", "prefix_hit")
    # a hit under --cache-threshold (0.3) of the prompt: by load (c is the least loaded once a and b are busier)
    a.load.queued_prompt_tokens = b.load.queued_prompt_tokens = 20
    long_tail = SYSTEM[: 15 * BLOCK_SIZE] + prompt(5, 600)  # 240 cached of 840 tokens: 0.29
    assert first(p, long_tail) == ("c", "least_loaded")
    assert first(p, long_tail[:800]) == ("b", "prefix_hit")  # 240 of 800: 0.3
    # a prompt's last token is always computed: a prompt that is exactly a cached chain counts one block less
    assert pool("prefill").routing.index.match("b", Route(SYSTEM).keys, 0.0) == 0
    p2 = pool("prefill", cache_threshold=0.0)
    add(p2, "x")
    y = add(p2, "y")
    p2.placed(y, Route(SYSTEM[: 2 * BLOCK_SIZE]))
    assert first(p2, SYSTEM[: 2 * BLOCK_SIZE]) == ("y", "prefix_hit")  # 1 usable block of 2
    assert first(p2, SYSTEM[: BLOCK_SIZE])[1] == "least_loaded"  # no usable block


def test_index_is_bounded_by_the_workers_cache_and_keeps_prefixes_longest():
    idx = PrefixIndex(max_age=100.0)
    keys = Route(prompt(6, 10 * BLOCK_SIZE)).keys
    other = Route(prompt(7, 10 * BLOCK_SIZE)).keys
    idx.add("w", keys, now=0.0, capacity=12)
    assert idx.match("w", keys, 0.0) == 10
    idx.add("w", other, now=1.0, capacity=12)  # 20 keys into 12: the first prompt keeps only its first 2 blocks
    assert idx.size("w") == 12
    assert idx.match("w", other, 1.0) == 10 and idx.match("w", keys, 1.0) == 2
    # aging: entries not refreshed within max_age no longer count
    assert idx.match("w", other, 101.0) == 10 and idx.match("w", other, 101.5) == 0
    idx.add("w", other[:3], now=200.0, capacity=12)
    assert idx.match("w", other, 200.0) == 3


def test_capacity_follows_the_workers_reported_kv_tokens():
    p = pool("prefill")
    a = add(p, "a", total_kv_tokens=4 * BLOCK_SIZE)
    p.placed(a, Route(prompt(8, 40 * BLOCK_SIZE)))
    assert p.routing.index.size("a") == 4
    a.load.total_kv_tokens = 0  # not polled yet: the default bound
    p.placed(a, Route(prompt(9, 40 * BLOCK_SIZE)))
    assert p.routing.index.size("a") == 44


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_or_removed_worker_stops_attracting_requests():
    p = pool("prefill")
    add(p, "a")
    b = add(p, "b", queued_prompt_tokens=5)
    p.placed(b, Route(SYSTEM + [1]))
    assert first(p, SYSTEM + [2]) == ("b", "prefix_hit")
    b.healthy = False  # as the server marks a worker that answered UNAVAILABLE
    assert [w.address for w in p.candidates(0, Route(SYSTEM + [2]))] == ["a"]
    # a failed poll forgets what the worker held (it may come back restarted, with an empty cache)
    dead = f"127.0.0.1:{free_port()}"
    q = WorkerPool("prefill", [dead], None, poll_seconds=0.2)
    q.routing.index.add(dead, Route(SYSTEM).keys, 0.0, 100)
    q.refresh()
    assert not q.workers[dead].healthy and q.routing.index.size(dead) == 0
    # a worker discovery no longer lists is dropped with its entries
    q._static = []
    q._dns = "no-such-host.invalid:1"
    q.routing.index.add(dead, Route(SYSTEM).keys, 0.0, 100)
    q.refresh()
    assert dead not in q.workers and q.routing.index.size(dead) == 0  # (its channel closed with it)


def test_round_robin_spreads_requests_and_each_keeps_its_turn():
    p = pool("prefill", "round_robin")
    for name in ("a", "b", "c"):
        add(p, name, queued_prompt_tokens=100 if name == "b" else 0)
    routes = [Route(SYSTEM + [i]) for i in range(6)]
    got = [p.candidates(0, r)[0].address for r in routes]
    assert got == ["a", "b", "c", "a", "b", "c"]  # the same prefix, loads ignored
    assert [p.candidates(0, routes[1])[0].address for _ in range(3)] == ["b"] * 3  # a retry stays on its turn
    assert routes[1].reason("prefill", "b") == "round_robin"


def test_least_loaded_ignores_the_cache():
    p = pool("prefill", "least_loaded")
    a = add(p, "a", queued_prompt_tokens=10)
    add(p, "b")
    p.placed(a, Route(SYSTEM + [1]))
    assert first(p, SYSTEM + [2]) == ("b", "least_loaded")
    assert p.routing.index.size("a") == 0  # and learns nothing: requests pay no hashing for it


def test_conversation_next_turn_prefers_the_decode_worker_of_its_last_turn():
    p = pool("decode")
    a = add(p, "a", free_kv_tokens=(1 << 14) - 500)  # the busier (KV tokens in use)
    b = add(p, "b")
    turn1 = SYSTEM + prompt(10, 50)
    answer = prompt(11, 200)
    p.placed(b, Route(turn1))  # b was sent the same first turn (another conversation), a this one:
    r = Route(turn1)
    p.placed(a, r)
    p.placed(a, r, turn1 + answer)  # and a holds the answer too, as it finished
    turn2 = turn1 + answer + prompt(12, 40)
    assert p.routing.index.match("a", Route(turn2).keys, 0.0) == len(turn1 + answer) // BLOCK_SIZE
    assert first(p, turn2, lease=len(turn2) + 3) == ("a", "prefix_hit")
    # a worker without room for the lease is not preferred for its cache: the next longest hit is
    a.load.free_state_slots = 0
    assert first(p, turn2, lease=len(turn2) + 3) == ("b", "prefix_hit")
    b.load.free_kv_tokens = len(turn2)  # neither has room: by load (a, without a slot, costs the most)
    assert first(p, turn2, lease=len(turn2) + 3) == ("b", "least_loaded")


def test_config_rejects_bad_values():
    for kw in ({"policy": "random"}, {"cache_threshold": 1.5}, {"balance_abs_threshold": -1},
               {"balance_rel_threshold": 0.5}):
        with pytest.raises(ValueError):
            RoutingConfig(**kw)
    assert routing.POLICIES == ("cache_aware", "least_loaded", "round_robin")


def test_serve_passes_its_routing_flags_to_the_router():
    import argparse

    from router.main import add_args as router_args
    from router.routing import routing_argv
    from tandem.launch import add_args as serve_args

    serve_ap, router_ap = argparse.ArgumentParser(), argparse.ArgumentParser()
    serve_args(serve_ap)
    router_args(router_ap)
    flags = ["--routing-policy", "round_robin", "--cache-threshold", "0.5", "--balance-abs-threshold", "100",
             "--balance-rel-threshold", "2.5"]
    got = RoutingConfig.from_args(router_ap.parse_args(routing_argv(serve_ap.parse_args(flags))))
    assert got == RoutingConfig("round_robin", 0.5, 100, 2.5)
    assert RoutingConfig.from_args(router_ap.parse_args([])) == RoutingConfig("cache_aware", 0.3, 4096, 1.5)
