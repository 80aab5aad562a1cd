"""The benchmarks' machine-ceiling measurements: wrk output parsing, the bare aiohttp loop, wrk absent."""

import asyncio
import shutil
from pathlib import Path

import pytest

from gym_ray.bench import latency, ray_bench
from gym_ray.errors import UsageError

_WRK_OUTPUT = """Running 10s test @ http://127.0.0.1:40123/run
  1 threads and 256 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   {latency}    5.10ms 612.40ms   91.30%
    Req/Sec   491.55    120.02   0.98k    70.00%
  Latency Distribution
     50%  505.11ms
     75%  507.92ms
     90%  512.00ms
     99%  540.37ms
  4889 requests in 10.00s, 5.11MB read
{errors}Requests/sec:    488.90
Transfer/sec:    523.19KB
"""


@pytest.mark.parametrize(
    ("latency_text", "latency_ms"),
    [
        pytest.param("508.12ms", 508.12, id="ms"),
        pytest.param("750.00us", 0.75, id="us"),
        pytest.param("1.50s", 1500.0, id="s"),
    ],
)
def test_parse_wrk_output_reads_rate_and_average_latency_in_ms(latency_text: str, latency_ms: float) -> None:
    rate, avg_ms = latency.parse_wrk_output(_WRK_OUTPUT.format(latency=latency_text, errors=""))
    assert rate == 488.9
    assert avg_ms == pytest.approx(latency_ms, rel=1e-12)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("Running 10s test\n", "no Requests/sec or Latency line", id="no-figures"),
        pytest.param(
            _WRK_OUTPUT.format(latency="508.12ms", errors="  Non-2xx or 3xx responses: 12\n"),
            "wrk got 12 non-2xx/3xx replies",
            id="error-replies",
        ),
    ],
)
def test_parse_wrk_output_refuses_unusable_output(text: str, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        latency.parse_wrk_output(text)


@pytest.mark.parametrize(
    ("body", "quoted"),
    [
        pytest.param('{"a": "b"}', '[[{"a": "b"}]]', id="plain"),
        pytest.param('{"a": [["x"]]}', '[=[{"a": [["x"]]}]=]', id="body-with-closing-brackets"),
    ],
)
def test_wrk_script_posts_the_body_verbatim_as_json(body: str, quoted: str) -> None:
    assert latency.wrk_script(body) == (
        f'wrk.method = "POST"\nwrk.body = {quoted}\nwrk.headers["Content-Type"] = "application/json"\n'
    )


@pytest.mark.parametrize(
    ("targets", "in_flight", "n"),
    [
        pytest.param(0, 4, 10, id="no-targets"),
        pytest.param(3, 2, 10, id="more-targets-than-loops"),
        pytest.param(1, 4, -1, id="negative-count"),
    ],
)
async def test_bare_aiohttp_loop_refuses_bad_arguments(targets: int, in_flight: int, n: int) -> None:
    with pytest.raises(UsageError, match="bare_aiohttp_loop"):
        await latency.bare_aiohttp_loop(
            [("http://127.0.0.1:9/run", latency.bench_rows)] * targets, n, 0, in_flight
        )


def test_bare_ceiling_splits_loops_and_rows_evenly_over_the_env_servers() -> None:
    with ray_bench._servers_in_process(ray_bench._servers_config(0.0)) as servers:
        done, wall_s = asyncio.run(ray_bench._bare_ceiling(servers.config, in_flight_total=5, rollouts=7))
        counts = {env: servers.stats(env) for env in ray_bench.ENVS}
    assert done == 7
    assert wall_s > 0
    # warm-up of 5 rows split 3 + 2, then 7 timed rows split 4 + 3
    assert {env: (s.requests, s.completed) for env, s in counts.items()} == {
        "arith_env": (7, 7),
        "arith_env_hard": (5, 5),
    }


def test_latency_bench_without_wrk_reports_none_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no wrk
    result = latency.run_latency_bench(latency_ms=20, in_flight=4, rollouts=16)
    assert result["wrk_rollouts_per_s"] is None
    assert result["wrk_efficiency"] is None
    assert result["wrk_latency_avg_ms"] is None
    assert result["collector_vs_bare"] == pytest.approx(
        result["efficiency"] / result["bare_aiohttp_efficiency"], rel=1e-12
    )
    assert "wrk: not on PATH" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_latency_bench_with_wrk_reports_its_rate_over_the_ideal() -> None:
    result = latency.run_latency_bench(latency_ms=20, in_flight=4, rollouts=16)
    # wrk really loaded the 20 ms server: no reply can come back sooner than the server's sleep, and
    # 4 connections at >= 20 ms each cannot complete more than 4 / 0.020 = 200 requests per second
    # (Little's law; 10% for the edges of wrk's measuring window)
    assert result["ideal_rollouts_per_s"] == 200.0
    assert result["wrk_latency_avg_ms"] >= 20.0
    assert 0 < result["wrk_rollouts_per_s"] <= 200.0 * 1.1
    assert result["wrk_efficiency"] == result["wrk_rollouts_per_s"] / result["ideal_rollouts_per_s"]


def test_wrk_ceiling_is_none_without_wrk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no wrk
    config = ray_bench._servers_config(0.0)  # never contacted: wrk is looked up first
    assert asyncio.run(ray_bench._wrk_ceiling(config, 4, 1, 0.0)) is None


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_wrk_ceiling_loads_every_env_server() -> None:
    with ray_bench._servers_in_process(ray_bench._servers_config(0.0)) as servers:
        rate = asyncio.run(ray_bench._wrk_ceiling(servers.config, 4, 1, 0.0))
        requests = {env: servers.stats(env).requests for env in ray_bench.ENVS}
    assert rate is not None
    assert rate > 0
    # every environment server got wrk's requests (the ceiling is over all of them, not the first)
    assert sorted(requests) == sorted(ray_bench.ENVS)
    assert min(requests.values()) > 0
