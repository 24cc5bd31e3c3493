"""The episode registry: claims, closing in every order, timeouts, whole groups only."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ajet.errors import EngineStateConflict, SwarmHTTPError, SwarmNotFound
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.trajectory import Completion
from ajet.protocol import EngineState
from tests.support.engine import FakeClock


def make(group_size: int = 2, max_in_flight: int = 100, timeout: float = 10.0
         ) -> tuple[EpisodeRegistry, FakeClock]:
    clock = FakeClock()
    reg = EpisodeRegistry(group_size=group_size, max_in_flight=max_in_flight,
                          default_timeout_s=timeout, clock=clock)
    reg.set_state(EngineState.ROLLING)
    return reg, clock


def completion(n: int = 3) -> Completion:
    return Completion(prompt_ids=(1, 2), response_ids=tuple(range(n)), logprobs=(-1.0,) * n,
                      finish_reason="length", policy_step=0)


def test_begin_is_refused_unless_rolling_with_state_and_retry_hint() -> None:
    reg, _ = make()
    for state in (EngineState.BOOTING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING):
        reg.set_state(state)
        with pytest.raises(EngineStateConflict) as info:
            reg.begin()
        assert info.value.status == 409
        assert state.value in info.value.detail
        assert "retry" in info.value.hint and info.value.retry_after_s
    reg.set_state(EngineState.ROLLING)
    assert reg.begin().uuid


def test_slots_are_limited_and_freed_by_end_abort_and_timeout() -> None:
    reg, clock = make(max_in_flight=3, timeout=5.0)
    a, b, c = reg.begin(), reg.begin(), reg.begin()
    with pytest.raises(EngineStateConflict, match="slots"):
        reg.begin()
    reg.end(a.uuid, task_id="t", reward=1.0)
    d = reg.begin()
    assert reg.abort(b.uuid) is True  # claims are open: the slot is re-queued at once
    e = reg.begin()
    clock.now += 6.0
    assert set(reg.sweep()) == {c.uuid, d.uuid, e.uuid}
    assert reg.in_flight() == 0
    reg.begin()


def test_unknown_and_closed_episodes_are_404_and_409() -> None:
    reg, _ = make()
    with pytest.raises(SwarmNotFound) as info:
        reg.end("nope", task_id="t", reward=0.0)
    assert info.value.status == 404
    ep = reg.begin()
    reg.end(ep.uuid, task_id="t", reward=0.5)
    for call in (lambda: reg.end(ep.uuid, task_id="t", reward=0.5),
                 lambda: reg.abort(ep.uuid), lambda: reg.chat_started(ep.uuid)):
        with pytest.raises(EngineStateConflict, match="already ended") as closed:
            call()
        assert closed.value.status == 409


def test_busy_episode_never_times_out_and_idle_counts_from_last_activity() -> None:
    reg, clock = make(timeout=5.0)
    ep = reg.begin()
    reg.chat_started(ep.uuid)
    clock.now += 60.0
    assert reg.sweep() == []  # a completion is being generated
    assert reg.chat_finished(ep.uuid, completion())
    clock.now += 4.0
    assert reg.sweep() == []
    clock.now += 2.0
    assert reg.sweep() == [ep.uuid]
    with pytest.raises(EngineStateConflict, match="timed out"):
        reg.end(ep.uuid, task_id="t", reward=1.0)


def test_an_expired_claim_is_timed_out_at_the_next_call_even_before_a_sweep() -> None:
    reg, clock = make(timeout=5.0)
    ep = reg.begin()
    clock.now += 6.0
    with pytest.raises(EngineStateConflict, match="timed out"):
        reg.end(ep.uuid, task_id="t", reward=1.0)
    assert reg.in_flight() == 0 and reg.counters["timed_out"] == 1
    assert reg.sweep() == []


def test_per_episode_timeout_overrides_the_default() -> None:
    reg, clock = make(timeout=100.0)
    short = reg.begin(timeout_s=1.0)
    long = reg.begin()
    clock.now += 2.0
    assert reg.sweep() == [short.uuid]
    assert reg.in_flight() == 1 and long.uuid


def test_completion_of_an_aborted_episode_is_dropped() -> None:
    reg, _ = make()
    ep = reg.begin()
    reg.chat_started(ep.uuid)
    reg.abort(ep.uuid)
    assert reg.chat_finished(ep.uuid, completion()) is False


def test_groups_form_by_task_in_order_and_are_taken_whole() -> None:
    reg, _ = make(group_size=2)
    eps = [reg.begin() for _ in range(5)]
    reg.end(eps[0].uuid, task_id="a", reward=1.0)
    reg.end(eps[1].uuid, task_id="b", reward=1.0)
    reg.end(eps[2].uuid, task_id="b", reward=0.0)  # b completes first
    reg.end(eps[3].uuid, task_id="a", reward=0.0)
    reg.end(eps[4].uuid, task_id="a", reward=0.5)  # starts a second group of a
    assert reg.ready_groups() == 2
    first, second = reg.take_groups(1), reg.take_groups(5)
    assert [g.task_id for g in first + second] == ["b", "a"]
    assert [e.uuid for e in first[0].episodes] == [eps[1].uuid, eps[2].uuid]
    assert reg.take_groups(1) == []  # the lone "a" episode waits for its group
    assert reg.snapshot()["episodes_waiting"] == 1


CLOSING_OPS = ("end", "abort", "timeout", "chat")


@pytest.mark.parametrize("ops", [seq for n in (1, 2, 3)
                                 for seq in itertools.product(CLOSING_OPS, repeat=n)])
def test_every_order_of_end_abort_timeout_keeps_groups_and_trains_once(ops: tuple[str, ...]
                                                                       ) -> None:
    """Episode A gets `ops` in order; B and C of the same task always end.

    Only A's first closing op counts; later ones are 409 (never another error); a
    completed group is never lost and no episode is taken twice.
    """
    reg, clock = make(group_size=2, timeout=5.0)
    a, b = reg.begin(), reg.begin()
    reg.end(b.uuid, task_id="t", reward=0.0)
    first_close: str | None = None
    for op in ops:
        try:
            if op == "end":
                reg.end(a.uuid, task_id="t", reward=1.0)
            elif op == "abort":
                reg.abort(a.uuid)
            elif op == "chat":
                reg.chat_started(a.uuid)
                reg.chat_finished(a.uuid, completion())
            else:
                clock.now += 6.0
                if not reg.sweep() and first_close is None:
                    pytest.fail("an idle claimed episode did not time out")
        except SwarmHTTPError as exc:
            assert first_close is not None, f"{op} refused on a live episode: {exc}"
            assert isinstance(exc, EngineStateConflict) and exc.status == 409
            continue
        if op != "chat" and first_close is None:
            first_close = op
    c = reg.begin()
    reg.end(c.uuid, task_id="t", reward=0.5)
    taken = reg.take_groups(10)
    uuids = [e.uuid for g in taken for e in g.episodes]
    assert len(uuids) == len(set(uuids))
    assert all(len(g.episodes) == 2 for g in taken)
    if first_close == "end":
        assert [sorted(e.uuid for e in g.episodes) for g in taken] == [sorted([a.uuid, b.uuid])]
        assert reg.snapshot()["episodes_waiting"] == 1  # C waits for its partner
    else:
        assert uuids == [b.uuid, c.uuid]
        assert reg.snapshot()["episodes_waiting"] == 0
    assert reg.in_flight() == (0 if first_close else 1)


def test_wait_until_sweeps_and_returns_false_on_stop() -> None:
    reg, clock = make(timeout=1.0)
    reg.begin()
    clock.now += 2.0
    stop = threading.Event()
    assert reg.wait_until(lambda: reg.in_flight() == 0, stop=stop, sweep_interval_s=0.01)
    stop.set()
    assert reg.wait_until(lambda: False, stop=stop, sweep_interval_s=0.01) is False


class RegistryMachine(RuleBasedStateMachine):
    """Random interleavings of claims, chats, ends, aborts, timeouts and training."""

    def __init__(self) -> None:
        super().__init__()
        self.reg, self.clock = make(group_size=3, max_in_flight=6, timeout=5.0)
        self.issued: list[str] = []
        self.ended: set[str] = set()
        self.taken: Counter[str] = Counter()

    @rule(timeout=st.sampled_from([None, 1.0, 20.0]))
    def begin(self, timeout: float | None) -> None:
        try:
            self.issued.append(self.reg.begin(timeout_s=timeout).uuid)
        except EngineStateConflict:
            assert (self.reg.state != EngineState.ROLLING
                    or self.reg.in_flight() >= self.reg.max_in_flight)

    @precondition(lambda self: self.issued)
    @rule(i=st.integers(0, 1000), task=st.sampled_from(["x", "y"]), reward=st.floats(-1, 1))
    def end(self, i: int, task: str, reward: float) -> None:
        uuid = self.issued[i % len(self.issued)]
        try:
            self.reg.end(uuid, task_id=task, reward=reward)
            assert uuid not in self.ended
            self.ended.add(uuid)
        except EngineStateConflict:
            pass

    @precondition(lambda self: self.issued)
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        with contextlib.suppress(EngineStateConflict):
            self.reg.abort(self.issued[i % len(self.issued)])

    @precondition(lambda self: self.issued)
    @rule(i=st.integers(0, 1000))
    def chat(self, i: int) -> None:
        uuid = self.issued[i % len(self.issued)]
        try:
            self.reg.chat_started(uuid)
        except EngineStateConflict:
            return
        self.reg.chat_finished(uuid, completion())

    @rule()
    def unknown(self) -> None:
        with pytest.raises(SwarmNotFound):
            self.reg.end("never-issued", task_id="x", reward=0.0)

    @rule(dt=st.floats(0.0, 8.0))
    def tick(self, dt: float) -> None:
        self.clock.now += dt
        self.reg.sweep()

    @rule(state=st.sampled_from([EngineState.ROLLING, EngineState.ROLLING_POST,
                                 EngineState.WEIGHT_SYNCING]))
    def set_state(self, state: EngineState) -> None:
        self.reg.set_state(state)

    @rule(n=st.integers(1, 3))
    def train(self, n: int) -> None:
        for group in self.reg.take_groups(n):
            assert len(group.episodes) == 3
            assert {e.task_id for e in group.episodes} == {group.task_id}
            for e in group.episodes:
                self.taken[e.uuid] += 1

    @invariant()
    def trained_at_most_once_and_nothing_lost(self) -> None:
        assert all(count == 1 for count in self.taken.values())
        assert set(self.taken) <= self.ended
        snap = self.reg.snapshot()
        # every ended episode is either taken or waiting in a group
        assert len(self.ended) == sum(self.taken.values()) + snap["episodes_waiting"]
        assert self.reg.in_flight() <= self.reg.max_in_flight


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
