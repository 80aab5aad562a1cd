import pickle

import pytest

from gym_ray import errors


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(errors.ConfigError("bad key", key="a.b"), id="config"),
        pytest.param(errors.InputError("bad line", path="x.jsonl", line=3), id="input"),
        pytest.param(
            errors.ServerHTTPError("boom", url="http://h/run", status=503, body_excerpt="x"), id="http"
        ),
        pytest.param(errors.ValidationError("bad rows", problems=["row 1", "row 2"]), id="validation"),
        pytest.param(errors.ShardLockError("stale"), id="lock"),
        pytest.param(
            errors.ShardLockError("stale", shard="s0", holder_pid=7, holder_host="h"), id="lock-holder"
        ),
        pytest.param(errors.AggregationError("agg", servers={"env": "boom"}), id="aggregation"),
    ],
)
def test_errors_pickle_round_trip_keeps_type_and_fields(exc: errors.GymRayError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.__dict__ == exc.__dict__


def test_bad_input_errors_are_value_errors_and_lock_errors_are_runtime_errors() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.RoutingError, errors.ConfigError)
    assert issubclass(errors.InputError, ValueError)
    assert issubclass(errors.ShardLockError, RuntimeError)
    assert not issubclass(errors.ServerError, ValueError)
