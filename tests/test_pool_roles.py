"""Roles: one Pool with several sets of workers, each call on the set it needs."""

from __future__ import annotations

import pytest

import fiber_core
from fiber_core.parallel.pool.roles import DEFAULT, parse_roles, route


def where(x: int) -> tuple[int, str]:
    return x, fiber_core.current_process().name


@fiber_core.meta(gpu=1)
def learn(batch: list[int]) -> tuple[int, str]:
    return sum(batch), fiber_core.current_process().name


# -- the decisions, pure -------------------------------------------------------------------------


def test_a_role_is_a_size_or_the_pools_keywords() -> None:
    assert parse_roles(None) == {}
    assert parse_roles({"learner": 2, "big": {"processes": 1, "memory": 4096}}) == {
        "learner": {"processes": 2}, "big": {"processes": 1, "memory": 4096}}


@pytest.mark.parametrize(("roles", "error", "message"), [
    ([("learner", 1)], TypeError, "roles must be a dict"),
    ({"Learner": 1}, ValueError, "use lowercase letters"),
    ({"": 1}, ValueError, "use lowercase letters"),
    ({"learner": "one"}, TypeError, "a size \\(an int\\) or a dict"),
    ({"learner": True}, TypeError, "a size \\(an int\\) or a dict"),
    ({"learner": {"processes": 1, "gpus": 1}}, TypeError, "unknown keyword\\(s\\) gpus"),
    ({"learner": {"gpu": 1}}, ValueError, "say how many workers"),
])
def test_a_bad_role_is_refused_with_what_to_write(roles: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        parse_roles(roles)  # type: ignore[arg-type]


def test_a_call_goes_where_it_is_named_else_where_its_resources_are_else_to_the_default() -> None:
    table = {DEFAULT: {"cpu": 1}, "learner": {"gpu": 1, "gpu_type": "a10g"}, "big": {"memory": 8192}}
    assert route(None, None, table) == DEFAULT
    assert route(None, {"gpu": None, "cpu": None}, table) == DEFAULT
    assert route("big", None, table) == "big"
    assert route(None, {"gpu": 1}, table) == "learner"
    assert route(None, {"gpu": 1, "gpu_type": "a10g"}, table) == "learner"
    assert route(None, {"memory": 4096}, table) == "big"
    assert route(None, {"cpu": 1}, table) == DEFAULT
    with pytest.raises(ValueError, match="no worker of this pool has what the function asks for \\(gpu=2\\)"):
        route(None, {"gpu": 2}, table)
    with pytest.raises(ValueError, match="no role 'learners' in this pool \\(its roles: 'learner', 'big'\\)"):
        route("learners", None, table)
    # A pool without roles runs everything, whatever a function's meta says.
    assert route(None, {"gpu": 4}, {DEFAULT: {}}) == DEFAULT


# -- a mixed pool, on real workers ---------------------------------------------------------------


def test_each_call_of_a_mixed_pool_runs_on_the_workers_of_its_role() -> None:
    with fiber_core.Pool(2, roles={"learner": {"processes": 1, "gpu": 1}}) as pool:
        rollouts = pool.map(where, range(40))
        assert [x for x, _ in rollouts] == list(range(40))
        assert {name.rsplit("-", 1)[0] for _, name in rollouts} == {"PoolWorker"}
        total, name = pool.apply(learn, ([x for x, _ in rollouts],))  # by its meta(gpu=1)
        assert total == sum(range(40)) and name.startswith("PoolWorker-learner-")
        named = pool.map(where, range(5), role="learner")
        assert {n for _, n in named} == {name}
        assert [x for x, _ in pool.imap_unordered(where, range(6), role="learner")] != []
        assert sorted(x for x, _ in pool.starmap(where, [(i,) for i in range(4)], role="learner")) == [0, 1, 2, 3]
        assert len(pool._pool) == 3
        assert pool.worker_resources == {} and "learner" in repr(pool._roles)
        pool.resize(2, role="learner")
        names = {n for _, n in pool.map(where, range(200), chunksize=1, role="learner")}
        assert names and all(n.startswith("PoolWorker-learner-") for n in names)
        with pytest.raises(ValueError, match="no role 'critic'"):
            pool.map(where, range(3), role="critic")
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply(learn, ([1],))


def test_a_mixed_pool_closes_and_joins_every_role() -> None:
    pool = fiber_core.Pool(1, roles={"learner": 1})
    learner = pool._roles["learner"]
    assert pool.apply(where, (1,), role="learner")[1].startswith("PoolWorker-learner-")
    pool.close()
    pool.join()
    assert all(not p.is_alive() for p in pool._pool)
    with pytest.raises(ValueError, match="Pool not running"):
        learner.map(where, [1])


def test_a_bad_role_is_refused_before_the_pool_starts() -> None:
    with pytest.raises(TypeError, match="unknown keyword"):
        fiber_core.Pool(1, roles={"learner": {"processes": 1, "gpus": 1}})
