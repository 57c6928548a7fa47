"""The compute thread's batching (`swarm.runtime.taskpool`): items of one key become one call, and the worker waits
briefly for the sources (sessions) due in a round, so that sessions whose steps arrive a little apart share a pass
instead of drifting into separate ones."""
from __future__ import annotations

import functools
import threading
import time

from swarm.runtime import taskpool
from swarm.runtime.taskpool import PRIORITY_DECODE, Gatherer, TaskPool


def _run_then_shut_down(pool: TaskPool, threads: list) -> None:
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pool.shutdown()


def _sessions(gather_max: float, stagger: float, steps: int = 8, work: float = 0.05) -> list:
    """Two sessions step in lock-step rounds through a pool, the second's item `stagger` s after the first's;
    returns batch sizes."""
    pool = TaskPool(adapt_threads=False, gather_max=gather_max)
    sizes = []

    def batch(items):
        sizes.append(len(items))
        time.sleep(work)  # the pass itself
        return [x * 2 for x in items]

    def session(index):
        for step in range(steps):
            if index == 1:
                time.sleep(stagger)
            assert pool.call_batchable(PRIORITY_DECODE, "decode", batch, step, source=f"s{index}") == step * 2

    _run_then_shut_down(pool, [threading.Thread(target=session, args=(i,)) for i in range(2)])
    return sizes


def test_staggered_sessions_share_passes():
    # a pass takes 50 ms, so the worker waits up to 25 ms: far more than the 10 ms stagger, even on a loaded machine
    sizes = _sessions(gather_max=0.5, stagger=0.01)
    assert sum(sizes) == 16
    # the first rounds teach the pool the sessions' periods; after that each round is one pass of both (the
    # session that started alone stays a step ahead, so the last step of the other runs alone)
    assert sizes.count(2) >= 5, sizes


def test_without_waiting_staggered_sessions_run_apart():
    sizes = _sessions(gather_max=0.0, stagger=0.01)
    assert sum(sizes) == 16 and max(sizes) == 1, sizes  # what the waiting above fixes


def test_a_single_source_never_waits():
    gatherer = Gatherer(gather_max=1.0)
    for t in (0.0, 0.1, 0.2):
        gatherer.note("k", ["a"], t)
    assert gatherer.due("k", {"a"}, 0.25) == {}


def test_a_source_that_went_quiet_is_no_longer_due():
    gatherer = Gatherer(gather_max=1.0)
    for t in (0.0, 0.1, 0.2):
        gatherer.note("k", ["a", "b"], t)
    gatherer.note("k", ["a"], 0.3)
    # its period is 0.1 s and it was last seen 0.11 s ago: expected at 0.3
    assert gatherer.due("k", {"a"}, 0.31) == {"b": 0.2 + 0.1}
    assert gatherer.due("k", {"a"}, 0.45) == {}  # more than two periods: it stopped (its session ended)
    gatherer.computed("k", 0.004)
    assert gatherer.wait_limit("k") == 0.002  # half a pass
    gatherer.note("k", ["a", "b"], 0.5)
    gatherer.forget("b")  # its session closed
    assert gatherer.due("k", {"a"}, 0.55) == {}


def _hold_turn(path: str, out, hold: float) -> None:
    from swarm.runtime.cpu_turns import CpuTurns

    turns = CpuTurns(path)
    for _ in range(3):
        with turns:
            began = time.monotonic()
            time.sleep(hold)
            out.put((began, time.monotonic()))


def test_processes_take_turns(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    path = str(tmp_path / "turns.lock")
    procs = [ctx.Process(target=_hold_turn, args=(path, out, 0.05)) for _ in range(2)]
    for p in procs:
        p.start()
    spans = sorted(out.get(timeout=60) for _ in range(6))
    for p in procs:
        p.join(timeout=60)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no two turns overlap


def test_a_pool_with_turns_runs_its_tasks_under_the_turn(tmp_path):
    from swarm.runtime.cpu_turns import CpuTurns

    turns = CpuTurns(str(tmp_path / "turns.lock"))
    pool = TaskPool(adapt_threads=False, turns=turns)
    try:
        assert pool.call(PRIORITY_DECODE, lambda: 7) == 7
        assert pool.call_batchable(PRIORITY_DECODE, "k", lambda items: [i + 1 for i in items], 1, source="a") == 2
    finally:
        pool.shutdown()
    assert turns.turns == 2


def _gatherer_with_groups(late: list, early: list, period: float = 0.2) -> Gatherer:
    """Sources seen every `period` s: `early` at 0, 0.2, ...; `late` half a period after them."""
    gatherer = Gatherer(gather_max=0.01)
    for round_ in range(3):
        gatherer.note("k", early, round_ * period)
        gatherer.note("k", late, round_ * period + period / 2)
    gatherer.computed("k", 0.05)
    return gatherer


def test_a_minority_waits_for_the_majority_to_merge():
    gatherer = _gatherer_with_groups(late=["x"], early=["a", "b", "c"])
    now = 0.5  # the late one's next item; the others were last seen at 0.4 and are due at 0.6
    missing = gatherer.due("k", {"x"}, now)
    assert set(missing) == {"a", "b", "c"}
    assert abs(gatherer.deadline("k", {"x"}, missing, now) - (0.6 + 0.01)) < 1e-9  # their arrival + the short wait


def test_a_majority_waits_only_briefly():
    gatherer = _gatherer_with_groups(late=["x"], early=["a", "b", "c"])
    now = 0.6
    missing = gatherer.due("k", {"a", "b", "c"}, now)
    assert set(missing) == {"x"}
    assert abs(gatherer.deadline("k", {"a", "b", "c"}, missing, now) - (now + 0.01)) < 1e-9


def test_of_equal_groups_the_one_without_the_lowest_source_waits():
    gatherer = _gatherer_with_groups(late=[1, 2], early=[3, 4])
    assert gatherer.deadline("k", {1, 2}, gatherer.due("k", {1, 2}, 0.5), 0.5) == 0.5 + 0.01
    assert gatherer.deadline("k", {3, 4}, gatherer.due("k", {3, 4}, 0.6), 0.6) > 0.6 + 0.05


def test_a_group_still_arriving_is_not_taken_for_a_minority():
    """Two of a group of five are in, three are on their way (expected now): with them, it is the larger group,
    so it waits only briefly; it must not wait a round for the group of three (which, seen from there, would
    wait for it in turn, each wait lengthening the next)."""
    gatherer = _gatherer_with_groups(late=["x", "y", "z"], early=["a", "b", "c", "d", "e"])
    now = 0.6
    missing = gatherer.due("k", {"a", "b"}, now)
    assert set(missing) == {"c", "d", "e", "x", "y", "z"}
    assert gatherer.deadline("k", {"a", "b"}, missing, now) == now + 0.01


def test_a_merging_wait_is_at_most_one_period_rare_and_off_without_waiting():
    gatherer = _gatherer_with_groups(late=["x"], early=["a", "b"], period=0.2)
    missing = {"a": 5.0, "b": 5.0}  # expected far later than one period
    assert abs(gatherer.deadline("k", {"x"}, missing, 0.5) - 0.7) < 1e-9
    # a merging wait just started: none again for 8 periods, only the short wait
    assert gatherer.deadline("k", {"x"}, missing, 0.7) == 0.7 + 0.01
    assert abs(gatherer.deadline("k", {"x"}, missing, 0.5 + 8 * 0.2 + 0.01) - (2.11 + 0.2)) < 1e-9
    gatherer.gather_max = 0.0
    assert gatherer.deadline("k", {"x"}, missing, 3.0) == 3.0


def test_groups_a_pass_apart_merge_into_one_batch():
    """Three sessions cycle through this pool (a 40 ms pass) and 120 ms elsewhere (the other servers and the
    client); the third starts 80 ms late, too far for the short wait: it waits for the other two once, then all
    three share every pass."""
    pool = TaskPool(adapt_threads=False, gather_max=0.01)
    sizes = []

    def batch(items):
        sizes.append(len(items))
        time.sleep(0.04)
        return items

    def session(name, delay):
        time.sleep(delay)
        for step in range(12):
            pool.call_batchable(PRIORITY_DECODE, "decode", batch, step, source=name)
            time.sleep(0.12)

    _run_then_shut_down(pool, [threading.Thread(target=session, args=(name, delay)) for name, delay in
                               (("a", 0.0), ("b", 0.0), ("c", 0.08))])
    assert sum(sizes) == 36
    # once merged, the three share passes; one pass may still split when a thread wakes more than the 10 ms
    # gather window late (seen ~1 run in 6 on 2 loaded cores, before and after the restructuring)
    merged = sizes[sizes.index(3):] if 3 in sizes else []
    assert sizes[-4:].count(3) >= 3 and merged.count(3) >= len(merged) - 2, sizes


def _expected_batch(arrival_gap: float, expect_second: bool, since_ago: float = 0.0) -> list:
    """Two sources with items of a tracked key: the second's item comes `arrival_gap` s after the first's; returns
    the batch sizes. `expect_second`: it was announced as on its way (`Gatherer.expect`), `since_ago` s ago."""
    pool = TaskPool(adapt_threads=False, gather_max=0.005)
    sizes = []

    def batch(items):
        sizes.append(len(items))
        return items

    pool.gatherer.expect("head", "a")
    if expect_second:
        pool.gatherer.expect("head", "b", time.monotonic() - since_ago)

    def second():
        time.sleep(arrival_gap)
        pool.call_batchable(PRIORITY_DECODE, "head", batch, 2, source="b")

    _run_then_shut_down(pool, [threading.Thread(target=pool.call_batchable, args=(PRIORITY_DECODE, "head", batch,
                                                                                   1), kwargs={"source": "a"}),
                               threading.Thread(target=second)])
    return sizes


def test_a_batch_waits_for_the_sources_on_their_way():
    # 60 ms apart: far past the 5 ms guess from periods, but b said it is coming (a session's step in the swarm)
    assert _expected_batch(0.06, expect_second=True) == [2]


def test_a_batch_does_not_wait_for_sources_not_on_their_way_nor_late_ones():
    assert _expected_batch(0.06, expect_second=False) == [1, 1]  # b's step is not in the swarm: nobody waits
    # b has been on its way for longer than twice the longest wait (a failover replaying history): not waited for
    assert _expected_batch(0.06, expect_second=True, since_ago=1.0) == [1, 1]


def test_other_work_is_not_held_up_by_a_wait_for_sources_on_their_way(monkeypatch):
    """A head batch waiting for a session on its way (up to `EXPECT_MAX`) lets other queued work (a newcomer's
    prompt head, its embedding) go after the short wait, not after the whole wait."""
    monkeypatch.setattr(taskpool, "EXPECT_MAX", 1.0)
    pool = TaskPool(adapt_threads=False, gather_max=0.02)
    pool.gatherer.expect("head", "b")  # never arrives: the batch of a would wait up to EXPECT_MAX
    waited = {}

    def timed(name, fn, delay):
        time.sleep(delay)
        began = time.monotonic()
        fn()
        waited[name] = time.monotonic() - began

    batch = lambda items: items  # noqa: E731
    threads = [threading.Thread(target=timed, args=("a", lambda: pool.call_batchable(
                   PRIORITY_DECODE, "head", batch, 1, source="a"), 0.0)),
               threading.Thread(target=timed, args=("prompt", lambda: pool.call_batchable(
                   PRIORITY_DECODE, "prompt head", batch, 1, source="c"), 0.05)),
               threading.Thread(target=timed, args=("call", lambda: pool.call(PRIORITY_DECODE, lambda: None), 0.06))]
    _run_then_shut_down(pool, threads)
    # they did not sit out a's wait for b (about a second: they waited 0.94 s before this was fixed)
    assert waited["prompt"] < 0.5 and waited["call"] < 0.5, waited


def test_turn_domains_have_their_own_lock_files(monkeypatch):
    from swarm.runtime.cpu_turns import DOMAIN_ENV, CpuTurns

    monkeypatch.delenv(DOMAIN_ENV, raising=False)
    plain = CpuTurns().path
    monkeypatch.setenv(DOMAIN_ENV, "gw0/../x")
    assert CpuTurns().path == plain.replace(".lock", "-gw0x.lock")  # a name, never a path
    monkeypatch.setenv(DOMAIN_ENV, "gw1")
    assert CpuTurns().path != plain.replace(".lock", "-gw0x.lock")


def test_turns_only_for_cpu_teams(monkeypatch):
    """A compute thread with one intra-op thread, or on CUDA, or with SWARMGATE_CPU_TURNS=0, takes no turns."""
    from swarm.runtime.cpu_turns import ENV, CpuTurns, turns_for

    monkeypatch.delenv(ENV, raising=False)
    assert isinstance(turns_for("cpu", 2), CpuTurns)
    assert turns_for("cpu", 1) is None
    assert turns_for("cuda", 8) is None
    monkeypatch.setenv(ENV, "0")
    assert turns_for("cpu", 2) is None


def _queued_behind_a_busy_worker(pool: TaskPool, callers: list) -> list:
    """Start the `callers` (each a function that queues one task) one by one from threads while the worker is busy
    with a task that waits until all are queued, so that they are queued in this order; returns the threads."""
    release = threading.Event()
    blocker = threading.Thread(target=pool.call, args=(PRIORITY_DECODE, release.wait, 30))
    blocker.start()
    while pool._queue.qsize():  # the worker took the blocking task
        time.sleep(0.001)
    threads = [blocker]
    for caller in callers:
        queued = pool._queue.qsize()
        threads.append(threading.Thread(target=caller))
        threads[-1].start()
        while pool._queue.qsize() == queued:  # in the queue before the next one starts
            time.sleep(0.001)
    release.set()
    return threads


def _prefills(pool: TaskPool, batch, costs: dict, budget) -> list:
    """A caller per item of `costs` (name -> cost): a prefill under the key "prefill" with `budget`."""
    return [functools.partial(pool.call_batchable, taskpool.PRIORITY_PREFILL, "prefill", batch, name, cost=cost,
                              budget=budget) for name, cost in costs.items()]


def test_a_budget_takes_queued_items_in_arrival_order_up_to_it():
    """A batch with a budget takes queued items of its key in arrival order while their costs fit (the first always
    goes: a chunk longer than the budget runs alone, and the short ones queued after it do not overtake it)."""
    pool = TaskPool(adapt_threads=False)
    passes = []

    def batch(items):
        passes.append(list(items))
        return items

    costs = {"a": 30, "b": 30, "c": 30, "long": 100, "d": 10, "e": 10, "f": 50}
    threads = _queued_behind_a_busy_worker(pool, _prefills(pool, batch, costs, 64))
    for t in threads:
        t.join()
    pool.shutdown()
    assert passes == [["a", "b"], ["c"], ["long"], ["d", "e"], ["f"]]


def test_without_a_budget_a_batch_takes_every_queued_item():
    pool = TaskPool(adapt_threads=False)
    passes = []

    def batch(items):
        passes.append(list(items))
        return items

    threads = _queued_behind_a_busy_worker(pool, _prefills(pool, batch, dict.fromkeys("abc", 100), None))
    for t in threads:
        t.join()
    pool.shutdown()
    assert passes == [["a", "b", "c"]]


def test_each_pass_delivers_at_its_end_and_decode_steps_go_between_passes():
    """The items of a pass get their results when that pass ends (before the next pass runs), and a decode step
    that arrives during a pass runs before the next pass of the queue."""
    pool = TaskPool(adapt_threads=False)
    order = []
    first_pass_back = threading.Event()
    decode_thread: list = []

    def prefill(items):
        order.append(list(items))
        if items == ["a", "b"]:  # a running conversation's decode step arrives during the first pass
            decode_thread.append(threading.Thread(target=pool.call_batchable, args=(
                PRIORITY_DECODE, "decode", lambda xs: order.append(list(xs)) or xs, "step")))
            decode_thread[0].start()
            while pool._queue.qsize() < 2:
                time.sleep(0.001)
        else:  # the first pass's callers have their results before this pass computes
            order.append("a and b back" if first_pass_back.wait(30) else "a and b still waiting")
        return items

    def caller(name):
        assert pool.call_batchable(taskpool.PRIORITY_PREFILL, "prefill", prefill, name, cost=30, budget=64) == name
        if name in "ab":
            done.append(name)
            if len(done) == 2:
                first_pass_back.set()

    done: list = []
    threads = _queued_behind_a_busy_worker(pool, [functools.partial(caller, name) for name in "abc"])
    for t in threads + decode_thread:
        t.join()
    pool.shutdown()
    assert order == [["a", "b"], ["step"], ["c"], "a and b back"]


def test_a_result_for_a_loop_that_closed_meanwhile_is_dropped():
    """A task submitted from an event loop that closes before the task ends (a stopping server's idle-time task): its
    result is dropped; the compute thread raises nothing and goes on with the next task."""
    import asyncio

    pool = TaskPool()
    gate = threading.Event()
    loop = asyncio.new_event_loop()

    async def submit():
        return pool.submit(PRIORITY_DECODE, gate.wait, 10)  # (not awaited: the loop closes first)

    loop.run_until_complete(submit())
    loop.close()
    gate.set()
    answers: list = []
    caller = threading.Thread(target=lambda: answers.append(pool.call(PRIORITY_DECODE, lambda: "next")), daemon=True)
    caller.start()
    caller.join(30)  # (a dead compute thread would never answer: a bound, not a timing)
    try:
        assert answers == ["next"] and pool.is_alive()
    finally:
        pool.shutdown(wait=5)
