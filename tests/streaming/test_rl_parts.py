"""The parts of the stream's RL features that need no Ray: groups, filters, step figures, option checks."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import gym_ray
from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import UsageError
from gym_ray.streaming.api import stream
from gym_ray.streaming.delivery import Delivery
from gym_ray.streaming.filters import drop_uniform_reward
from gym_ray.streaming.groups import RolloutGroup
from gym_ray.streaming.step_stats import StepMeter


def _item(task: int, rollout: int, version: int, reward: float | None) -> tuple[dict[str, Any], Any]:
    row = {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, keys.POLICY_VERSION: version}
    if reward is None:
        return row, RolloutFailureRecord(failure_class="agent_run_error", message="boom")
    return row, {"reward": reward}


def test_a_group_knows_its_oldest_and_newest_version_and_rewards() -> None:
    group = RolloutGroup([_item(7, 0, 3, 1.0), _item(7, 1, 1, 0.0), _item(7, 2, 2, None)])
    assert (group.task_index, group.oldest_version, group.newest_version) == (7, 1, 3)
    assert group.rewards == [1.0, 0.0, None]
    assert gym_ray.RolloutGroup is RolloutGroup
    assert gym_ray.drop_uniform_reward is drop_uniform_reward


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        pytest.param([1.0, 1.0, 1.0], False, id="all-right"),
        pytest.param([0.0, 0.0], False, id="all-wrong"),
        pytest.param([None, None], False, id="all-failed"),
        pytest.param([1.0], False, id="single"),
        pytest.param([1.0, 0.0, 1.0], True, id="mixed"),
        pytest.param([1.0, None], True, id="reward-and-failure"),
        pytest.param([0.5, 0.25], True, id="fractional"),
    ],
)
def test_drop_uniform_reward(rewards: list[float | None], keep: bool) -> None:
    group = RolloutGroup(_item(0, i, 0, r) for i, r in enumerate(rewards))
    assert drop_uniform_reward(group) is keep


def _delivery(**options: Any) -> tuple[Delivery, StepMeter]:
    meter = StepMeter("run")
    settings: dict[str, Any] = {
        "group_size": 2,
        "max_staleness": None,
        "on_stale": None,
        "group_filter": None,
    }
    settings.update(options)
    return Delivery(meter=meter, **settings), meter


def test_delivery_counts_filtered_groups_by_filter_name_and_refuses_a_non_bool_verdict() -> None:
    def short_answers(group: RolloutGroup) -> bool:
        return True

    delivery, meter = _delivery(group_filter=[short_answers, drop_uniform_reward])
    for gid, rewards in enumerate([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]):
        delivery.opened(gid)
        for index, reward in enumerate(rewards):
            row, outcome = _item(gid, index, 0, reward)
            assert delivery.accept(2 * gid + index, row, outcome, 0, 0) == []
    assert (delivery.open, delivery.buffered, dict(meter.filtered)) == (0, 2, {"drop_uniform_reward": 2})
    entry, requeue = delivery.take(0)
    assert entry is not None
    assert (entry[0], entry[1].task_index, requeue) == (1, 1, [])

    delivery, _ = _delivery(group_filter=lambda group: "yes")
    delivery.opened(0)
    delivery.accept(0, *_item(0, 0, 0, 1.0), 0, 0)
    with pytest.raises(UsageError, match=r"group_filter <lambda> returned 'yes' for task 0"):
        delivery.accept(1, *_item(0, 1, 0, 1.0), 0, 0)


def test_delivery_requeues_only_the_stale_rollouts_of_a_group() -> None:
    seen: list[int] = []
    delivery, meter = _delivery(
        max_staleness=1, on_stale=lambda row, outcome: seen.append(row[keys.ROLLOUT_INDEX])
    )
    delivery.opened(0)
    delivery.accept(0, *_item(0, 0, 0, 1.0), 0, 1)  # version 0, current 1: within the bound
    delivery.accept(1, *_item(0, 1, 1, 0.0), 1, 1)
    entry, requeue = delivery.take(2)  # the version moved on: rollout 0 is now 2 behind
    assert entry is None
    assert [(seq, row[keys.ROLLOUT_INDEX], keys.POLICY_VERSION in row) for seq, row in requeue] == [
        (0, 0, False)
    ]
    assert (seen, meter.stale, delivery.open, delivery.buffered) == ([0], 1, 2, 0)
    delivery.accept(0, *_item(0, 0, 2, 1.0), 2, 2)
    entry, requeue = delivery.take(2)
    assert entry is not None
    gid, group = entry
    assert (gid, group.oldest_version, group.newest_version, requeue) == (0, 1, 2, [])
    delivery.commit([group], 2)
    assert (delivery.delivered, dict(meter.staleness)) == (2, {0: 1, 1: 1})


def test_step_meter_reports_to_opentelemetry() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    now = [100.0]
    meter = StepMeter("r1", clock=lambda: now[0], meter=provider.get_meter("test"))
    meter.pause()
    now[0] = 102.5
    meter.resume()
    meter.count("aborted", 3)
    meter.count("filtered", 2, reason="drop_uniform_reward")
    row = {keys.POLICY_VERSION: 1}
    meter.delivered(
        [(row, {keys.ENVIRONMENT_SERVER: "env", keys.NG_PERF: {"total_latency_ms": 40.0}})], current=3
    )
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        metric.name: metric.data.data_points
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert [p.value for p in points["gym_ray.stream.paused"]] == [2.5]
    assert [p.value for p in points["gym_ray.stream.aborted"]] == [3]
    filtered = points["gym_ray.stream.filtered"]
    assert [(p.value, p.attributes["reason"]) for p in filtered] == [(2, "drop_uniform_reward")]
    assert [(p.sum, p.count) for p in points["gym_ray.stream.staleness"]] == [(2, 1)]
    assert [(p.sum, p.attributes["server"]) for p in points["gym_ray.stream.rollout_latency"]] == [
        (40.0, "env")
    ]
    assert (meter.paused_s, meter.server_latency_ms(), dict(meter.staleness)) == (2.5, {"env": 40.0}, {2: 1})
    provider.shutdown()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"max_staleness": -1}, "max_staleness=-1 must be an int >= 0", id="staleness"),
        pytest.param({"policy_version": 1.5}, "policy_version=1.5 must be an int", id="version"),
        pytest.param({"group_filter": drop_uniform_reward}, "group_filter needs group_size", id="filter"),
        pytest.param({"on_stale": print}, "on_stale needs max_staleness", id="on-stale"),
        pytest.param({"max_groups_in_flight": 0}, "max_groups_in_flight=0", id="groups"),
        pytest.param(
            {"group_size": 2, "group_filter": [drop_uniform_reward, drop_uniform_reward]},
            "share a name",
            id="same-name",
        ),
    ],
)
def test_bad_rl_options_are_usage_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        stream([], config={}, **options)


async def test_bad_control_calls_are_usage_errors() -> None:
    rollouts = stream([], config={}, policy_version=2)
    with pytest.raises(UsageError, match=r"set_policy_version\(1\): versions are ints that never go back"):
        await rollouts.set_policy_version(1)
    with pytest.raises(UsageError, match="mode must be 'drain' or 'abort'"):
        await rollouts.pause("now")  # type: ignore[arg-type]
    for call, match in (
        (rollouts.next_batch(0), "n_groups must be an int >= 1"),
        (rollouts.next_batch(2, oversample=0.5), "oversample=0.5"),
        (rollouts.next_batch(2, timeout_s=0), "timeout_s=0"),
    ):
        with pytest.raises(UsageError, match=match):
            await call
    assert rollouts.policy_version == 2


def test_the_sync_stream_mirrors_every_public_member_of_the_async_stream() -> None:
    import inspect

    from gym_ray.streaming.stream import RolloutStream
    from gym_ray.streaming.sync import SyncRolloutStream

    def public(cls: type) -> dict[str, list[str]]:
        out = {}
        for name, member in inspect.getmembers(cls):
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                out[name] = ["property"]
            else:
                out[name] = [p for p in inspect.signature(member).parameters if p != "self"]
        return out

    renamed = {"aclose": "close", "aclose_and_drain": "close_and_drain"}
    expected = {renamed.get(name, name): params for name, params in public(RolloutStream).items()}
    assert public(SyncRolloutStream) == expected


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        pytest.param([1.0, 0.0], True, id="no-failure"),
        pytest.param([1.0, None], False, id="one-failure"),
        pytest.param([None, None], False, id="all-failed"),
    ],
)
def test_drop_failed(rewards: list[float | None], keep: bool) -> None:
    group = RolloutGroup(_item(0, i, 0, r) for i, r in enumerate(rewards))
    assert gym_ray.drop_failed(group) is keep
    assert len(group.failures) == rewards.count(None)


def test_group_advantages_are_mean_centred_and_leave_failures_out() -> None:
    group = RolloutGroup(
        [_item(0, 0, 0, 1.0), _item(0, 1, 0, None), _item(0, 2, 0, 0.0), _item(0, 3, 0, 0.5)]
    )
    assert group.advantages() == [0.5, None, -0.5, 0.0]
    # population std of (1, 0, 0.5) is sqrt(1/6)
    normalized = group.advantages(normalize=True, eps=0.0)
    assert normalized[1] is None
    assert [round(a, 12) for a in normalized if a is not None] == [
        round(0.5 / (1 / 6) ** 0.5, 12),
        round(-0.5 / (1 / 6) ** 0.5, 12),
        0.0,
    ]
    assert RolloutGroup([_item(0, 0, 0, 1.0), _item(0, 1, 0, 1.0)]).advantages(normalize=True) == [0.0, 0.0]
    assert RolloutGroup([_item(0, 0, 0, None)]).advantages() == [None]


def test_a_failed_rollout_runs_again_with_the_next_attempt_until_max_rollout_attempts() -> None:
    delivery, meter = _delivery(max_rollout_attempts=3)
    delivery.opened(0)
    row, failure = _item(0, 0, 0, None)
    del row[keys.POLICY_VERSION]
    [again] = delivery.accept(0, dict(row), failure, 0, 0)
    assert again == (0, {keys.TASK_INDEX: 0, keys.ROLLOUT_INDEX: 0, keys.ATTEMPT_INDEX: 1})
    [again] = delivery.accept(0, again[1], failure, 0, 0)
    assert again == (0, {keys.TASK_INDEX: 0, keys.ROLLOUT_INDEX: 0, keys.ATTEMPT_INDEX: 2})
    assert delivery.accept(0, again[1], failure, 0, 0) == []  # the third attempt's record is kept
    assert delivery.accept(1, *_item(0, 1, 0, 1.0), 0, 0) == []
    assert (meter.retried, delivery.buffered, delivery.open) == (2, 2, 0)
    # a terminal failure is delivered at once
    terminal = RolloutFailureRecord(failure_class="environment_server_failed", message="no", terminal=True)
    delivery.opened(1)
    assert delivery.accept(2, {keys.TASK_INDEX: 1, keys.ROLLOUT_INDEX: 0}, terminal, 0, 0) == []
    assert meter.retried == 2


def test_one_version_groups_run_the_older_members_again_until_the_group_has_one_version() -> None:
    seen: list[int] = []
    delivery, meter = _delivery(
        group_size=3,
        one_version_groups=True,
        on_stale=lambda row, outcome: seen.append(row[keys.ROLLOUT_INDEX]),
    )
    delivery.opened(0)
    assert delivery.accept(0, *_item(0, 0, 0, 1.0), 0, 1) == []
    assert delivery.accept(1, *_item(0, 1, 1, 0.0), 1, 1) == []
    requeue = delivery.accept(2, *_item(0, 2, 0, 0.5), 0, 1)  # complete, versions {0, 1}
    assert [(seq, keys.POLICY_VERSION in row) for seq, row in requeue] == [(0, False), (2, False)]
    assert (seen, meter.stale, delivery.buffered, delivery.open) == ([0, 2], 2, 0, 3)
    assert delivery.accept(0, *_item(0, 0, 1, 1.0), 1, 1) == []
    assert delivery.accept(2, *_item(0, 2, 1, 0.0), 1, 1) == []
    entry, _ = delivery.take(1)
    assert entry is not None
    assert (entry[1].oldest_version, entry[1].newest_version, delivery.open) == (1, 1, 0)
    # without the option the mixed group is delivered as it is
    plain, _ = _delivery(group_size=2)
    plain.opened(0)
    plain.accept(0, *_item(0, 0, 0, 1.0), 0, 1)
    assert plain.accept(1, *_item(0, 1, 1, 1.0), 1, 1) == []
    entry, _ = plain.take(1)
    assert entry is not None
    assert (entry[1].oldest_version, entry[1].newest_version) == (0, 1)


def test_the_rate_counts_from_the_workers_start_not_from_the_stream_object() -> None:
    now = [10.0]
    meter = StepMeter("r1", clock=lambda: now[0])
    now[0] = 14.0  # Ray started and the config was checked meanwhile
    meter.begin()
    now[0] = 16.0
    assert meter.rate(10) == 5.0


def test_a_group_filter_judges_each_task_once_even_after_a_stale_re_run() -> None:
    calls: list[int] = []

    def counting(group: RolloutGroup) -> bool:
        calls.append(group.task_index)
        return True

    delivery, meter = _delivery(max_staleness=0, group_filter=counting)
    delivery.opened(0)
    delivery.accept(0, *_item(0, 0, 0, 1.0), 0, 0)
    delivery.accept(1, *_item(0, 1, 0, 0.0), 0, 0)
    assert calls == [0]
    entry, requeue = delivery.take(1)  # the version moved on before delivery: both members are stale
    assert entry is None
    assert [seq for seq, _ in requeue] == [0, 1]
    delivery.accept(0, *_item(0, 0, 1, 1.0), 1, 1)
    delivery.accept(1, *_item(0, 1, 1, 0.0), 1, 1)
    entry, _ = delivery.take(1)
    assert entry is not None
    assert (calls, meter.stale, delivery.passed) == ([0], 2, set())
