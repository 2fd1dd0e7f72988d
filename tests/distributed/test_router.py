"""The routing policy alone: load, prefix affinity, overload and dead replicas (no processes)."""
from __future__ import annotations

import pytest

from loopline.distributed.router import LoadAffinityRouter, ReplicaLoad
from loopline.errors import EngineDeadError, InvalidRequestError

IDLE = ReplicaLoad(alive=True, kv_total_blocks=100)


def loads(*specs: tuple) -> list[ReplicaLoad]:
    """``(in_flight, num_waiting, kv_used)`` per live replica; ``None`` for a dead one."""
    return [ReplicaLoad(False) if s is None else ReplicaLoad(True, s[0], s[1], s[2], 100) for s in specs]


def prompt(first: int, n: int = 40) -> list[int]:
    return [first] + list(range(100, 100 + n - 1))


def test_least_loaded_wins_by_in_flight_waiting_and_kv():
    r = LoadAffinityRouter(page_size=4)
    assert r.choose(None, loads((3, 0, 0), (1, 0, 0), (2, 0, 0))) == 1
    assert r.choose(None, loads((1, 1, 0), (2, 0, 0))) == 1  # a waiting request weighs twice
    assert r.choose(None, loads((1, 0, 90), (2, 0, 0))) == 1  # a nearly full KV pool weighs like ~7 requests


def test_ties_rotate_so_an_idle_pool_spreads_requests():
    r = LoadAffinityRouter(page_size=4)
    picks = [r.choose([i], [IDLE] * 3) for i in range(6)]  # prompts shorter than a page: no affinity
    assert picks == [0, 1, 2, 0, 1, 2]


def test_same_prefix_goes_to_the_same_replica_while_it_is_not_overloaded():
    r = LoadAffinityRouter(page_size=4, max_imbalance=2)
    first = r.choose(prompt(1), [IDLE] * 3)
    # the same leading pages (different tail) follow the first request, although others are idle
    assert r.choose(prompt(1, 60), loads(*[(2, 0, 0) if i == first else (0, 0, 0) for i in range(3)])) == first
    # a different first page is routed by load
    other = r.choose(prompt(2), loads(*[(2, 0, 0) if i == first else (0, 0, 0) for i in range(3)]))
    assert other != first
    # overloaded (3 more than the least loaded): the prefix moves to the least loaded replica, and stays there
    moved = r.choose(prompt(1), loads(*[(3, 0, 0) if i == first else (0, 0, 0) for i in range(3)]))
    assert moved != first
    assert r.choose(prompt(1), [IDLE] * 3) == moved


def test_a_full_kv_pool_breaks_affinity():
    r = LoadAffinityRouter(page_size=4, kv_high=0.9)
    assert r.choose(prompt(7), [IDLE, IDLE]) == 0
    assert r.choose(prompt(7), loads((0, 0, 95), (0, 0, 0))) == 1


def test_longest_known_prefix_decides():
    r = LoadAffinityRouter(page_size=4, max_imbalance=100)
    shared = list(range(8))  # two pages
    a = r.choose(shared + [50, 51, 52, 53], [IDLE, IDLE])
    b = r.choose(shared + [60, 61, 62, 63], loads(*[(1, 0, 0) if i == a else (0, 0, 0) for i in range(2)]))
    assert a == b  # the two shared pages keep it together
    # keys are chained: page 2 alone (after a different page 1) does not match
    assert r.prefix_keys([9, 9, 9, 9] + shared[4:])[1] != r.prefix_keys(shared)[1]


def test_dead_replicas_are_skipped_and_forgotten():
    r = LoadAffinityRouter(page_size=4)
    owner = r.choose(prompt(3), [IDLE, IDLE])
    dead = loads(*[None if i == owner else (5, 0, 0) for i in range(2)])
    assert r.choose(prompt(3), dead) == 1 - owner
    assert r.choose(prompt(4), loads(*[(0, 0, 0) if i == owner else (1, 0, 0) for i in range(2)])) == owner
    r.replica_died(owner)
    # forgotten: were the prefix still the dead replica's, it would go there (it is live again here, one
    # request busier, well within max_imbalance); instead it is routed by load
    assert r.choose(prompt(4), loads(*[(1, 0, 0) if i == owner else (0, 0, 0) for i in range(2)])) == 1 - owner
    with pytest.raises(EngineDeadError):
        r.choose(prompt(3), loads(None, None))


def test_bad_settings_name_the_field():
    with pytest.raises(InvalidRequestError) as info:
        LoadAffinityRouter(page_size=0)
    assert info.value.param == "page_size"
    with pytest.raises(InvalidRequestError) as info:
        LoadAffinityRouter(kv_high=1.5)
    assert info.value.param == "kv_high"
