"""``example_env``: the reference environment server (also usable as a ``responses_api_agents`` instance).

``POST /run`` takes a flat row or an episode envelope and answers one rollout with the simulated policy
(``policy.py``) or, when the instance sets ``policy_base_url``, a real Responses API model. The reward is
1.0 when the answer equals the row's ``expected_answer``, else 0.0. Replies never carry
collector-private keys.

Instance fields (all optional): ``seed`` (int), ``skill`` (0..1), ``latency_ms``, ``latency_jitter_ms``
(0 and 0 = instant mode, no sleep), ``model_name``, ``policy_base_url``, ``policy_model``, ``faults``
(``faults.FaultConfig``), ``capture_dir`` (a folder: each successful rollout's model calls are written to
``<capture_dir>/<instance>-<rollout label>.json`` and the result names the file in
``model_call_capture_path``; see :mod:`gym_ray.dispatch.enrich`), ``tracing`` (a
:class:`gym_ray.observe.tracing.TracingSettings` block; the ``tracer`` attribute may also be set directly:
``/run`` then records a SERVER span that continues the caller's W3C ``traceparent``).
Row fields read: ``responses_create_params``, ``expected_answer``, ``difficulty`` (0..1), ``fault``,
``fault_until_attempt``, ``force_failure`` (truthy; a string is the reason), ``force_failure_terminal``
(default true).

Other routes: ``POST /aggregate_metrics``, ``GET|POST /policy`` (``{"skill": x}`` sets the skill,
``{"latency_ms": t}`` the base latency of rollouts that start from then on),
``GET /_stats``, and the health routes.

Concurrency: handlers run on the server's event loop; a client disconnect cancels the handler (counted
in ``stats.cancelled``). The optional model client session lives as long as the app.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gym_ray import keys
from gym_ray.dispatch.enrich import MODEL_CALL_CAPTURE_PATH
from gym_ray.errors import ConfigError, InputError, ServerError
from gym_ray.observe.tracing import TRACING_KEY, Tracer, setup_tracing_from_config
from gym_ray.record.atomic import atomic_write_bytes
from gym_ray.servers import _web
from gym_ray.servers.faults import Fault, FaultConfig, inject, row_fault
from gym_ray.servers.policy import (
    RolloutKey,
    SimulatedPolicy,
    build_response,
    call_model,
    check_skill,
    extract_answer,
    question_text,
    row_seed,
)
from gym_ray.servers.stats import StatsRecorder

IMPLEMENTATION = "example_env"
DEFAULT_MODEL_NAME = "gym-ray-simulated-policy"
_DEFAULT_ROLLOUT_ID = re.compile(r"^(\d+)-(\d+)$")
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class ExampleEnvServer:
    """One ``example_env`` instance: its policy, fault plan, stats and aiohttp app.

    Args:
        name: the instance name (used in error messages and response ids).
        fields: the implementation's config fields.
        server_type: ``environment_servers`` or ``responses_api_agents``.

    Raises:
        ConfigError: a field has a bad type or range; the message names its dotted path.
    """

    def __init__(
        self, name: str, fields: Mapping[str, Any], *, server_type: str = keys.ENVIRONMENT_SERVERS
    ) -> None:
        where = f"{name}.{server_type}.{IMPLEMENTATION}"
        self.name = name
        self.server_type = server_type
        seed = fields.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{where}.seed = {seed!r} is not an integer", key=f"{where}.seed")
        try:
            skill = check_skill(fields.get("skill", 0.0))
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}", key=f"{where}.skill") from exc
        self.policy = SimulatedPolicy(
            seed=seed,
            skill=skill,
            latency_ms=_web.get_number(fields, "latency_ms", 0.0, where=where),
            latency_jitter_ms=_web.get_number(fields, "latency_jitter_ms", 0.0, where=where),
        )
        self.faults = FaultConfig.from_mapping(fields.get("faults"), key_path=f"{where}.faults")
        self.model_name = str(fields.get("model_name") or DEFAULT_MODEL_NAME)
        base_url = fields.get("policy_base_url")
        if base_url is not None and not isinstance(base_url, str):
            raise ConfigError(f"{where}.policy_base_url = {base_url!r} is not a URL string", key=where)
        self.policy_base_url: str | None = base_url or None
        model = fields.get("policy_model")
        self.policy_model: str | None = str(model) if model is not None else None
        capture_dir = fields.get("capture_dir")
        if capture_dir is not None and not isinstance(capture_dir, str):
            raise ConfigError(
                f"{where}.capture_dir = {capture_dir!r} is not a folder path string",
                key=f"{where}.capture_dir",
            )
        self.capture_dir: Path | None = Path(capture_dir) if capture_dir else None
        self.tracer: Tracer | None = (
            setup_tracing_from_config({TRACING_KEY: fields[TRACING_KEY]}) if TRACING_KEY in fields else None
        )
        self.stats = StatsRecorder()
        self._session: aiohttp.ClientSession | None = None

    def make_app(self) -> web.Application:
        """A fresh aiohttp application serving this instance."""
        app = web.Application(client_max_size=_web.MAX_BODY_BYTES)
        _web.add_health_routes(app)
        app.router.add_post("/run", self._handle_run)
        app.router.add_post("/aggregate_metrics", self._handle_aggregate)
        app.router.add_get("/policy", self._handle_get_policy)
        app.router.add_post("/policy", self._handle_set_policy)
        app.router.add_get("/_stats", self._handle_stats)
        if self.policy_base_url is not None:
            app.cleanup_ctx.append(self._model_session)
        return app

    async def _model_session(self, app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600.0)) as session:
            self._session = session
            try:
                yield
            finally:
                self._session = None

    # --- routes ---------------------------------------------------------------------------------

    async def _handle_run(self, request: web.Request) -> web.StreamResponse:
        if self.tracer is None:
            return await self._serve_run(request)
        with self.tracer.server_span(request.headers, server=self.name, route="/run") as span:
            response = await self._serve_run(request)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _serve_run(self, request: web.Request) -> web.StreamResponse:
        async with self.stats.tracking():
            body = await _web.read_json_object(request)
            if isinstance(body, web.Response):
                self.stats.requests += 1
                return body
            try:
                if keys.EPISODE_ID in body and keys.TASK in body:
                    return await self._run_episode(request, body)
                return await self._run_flat(request, body)
            except InputError as exc:
                return _web.error_response(422, f"POST /run on {self.name}: {exc}")

    async def _handle_aggregate(self, request: web.Request) -> web.Response:
        return await _web.handle_aggregate_metrics(
            request, self.stats, error_status=self.faults.aggregate_error_status
        )

    async def _handle_get_policy(self, request: web.Request) -> web.Response:
        return web.json_response(self.policy_settings())

    async def _handle_set_policy(self, request: web.Request) -> web.Response:
        body = await _web.read_json_object(request)
        if isinstance(body, web.Response):
            return body
        if "skill" in body:
            try:
                self.policy.skill = body["skill"]
            except ConfigError as exc:
                return _web.error_response(422, f"POST /policy on {self.name}: {exc}")
        if "latency_ms" in body:
            latency = body["latency_ms"]
            if isinstance(latency, bool) or not isinstance(latency, int | float) or latency < 0:
                return _web.error_response(
                    422, f"POST /policy on {self.name}: latency_ms = {latency!r} is not a number >= 0"
                )
            self.policy.latency_ms = float(latency)
        return web.json_response(self.policy_settings())

    async def _handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.snapshot().to_json())

    def policy_settings(self) -> dict[str, Any]:
        """The policy's current settings (``GET /policy``)."""
        return {
            "skill": self.policy.skill,
            "seed": self.policy.seed,
            "latency_ms": self.policy.latency_ms,
            "latency_jitter_ms": self.policy.latency_jitter_ms,
            "policy_base_url": self.policy_base_url,
        }

    # --- /run -----------------------------------------------------------------------------------

    async def _run_flat(self, request: web.Request, row: dict[str, Any]) -> web.StreamResponse:
        key = RolloutKey(
            task=_index(row.get(keys.TASK_INDEX, 0)),
            rollout=_index(row.get(keys.ROLLOUT_INDEX, 0)),
            attempt=_attempt(row.get(keys.ATTEMPT_INDEX)),
        )
        self.stats.count_request((key.task, key.rollout))
        fault = self._fault_for(row, key, where="row")
        if fault is not None:
            return await inject(request, fault)
        if row.get("force_failure"):
            reason, terminal = _forced_failure(row)
            return web.json_response(
                {
                    keys.FAILURE_CLASS: keys.FailureClass.ENVIRONMENT_SERVER_FAILED,
                    keys.FAILURE_TERMINAL: terminal,
                    keys.FAILURE_REASON: reason,
                    keys.FAILURE_KIND: "forced",
                }
            )
        try:
            result = await self.solve(row, key, where="row")
        except ServerError as exc:
            return _web.error_response(502, f"POST /run on {self.name}: {exc}")
        return web.json_response(result)

    async def _run_episode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        episode_id, task = body[keys.EPISODE_ID], body[keys.TASK]
        if not isinstance(episode_id, dict) or not isinstance(episode_id.get(keys.EPISODE_ROLLOUT_ID), str):
            raise InputError(f"episode_id = {episode_id!r:.120} needs a string rollout_id")
        attempt = episode_id.get(keys.EPISODE_ATTEMPT, 0)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise InputError(f"episode_id.attempt = {attempt!r} is not an int >= 0")
        if not isinstance(task, dict) or not isinstance(task.get(keys.TASK_ID), dict):
            raise InputError(f"task = {task!r:.120} needs a task_id object")
        task_input = task.get(keys.TASK_INPUT)
        if not isinstance(task_input, dict):
            raise InputError(f"task.task_input = {task_input!r:.120} is not an object")
        rollout_id: str = episode_id[keys.EPISODE_ROLLOUT_ID]
        m = _DEFAULT_ROLLOUT_ID.match(rollout_id)
        if m is not None:
            key = RolloutKey(task=int(m.group(1)), rollout=int(m.group(2)), attempt=attempt)
        else:
            key = RolloutKey(
                task=str(task[keys.TASK_ID].get(keys.TASK_ID)), rollout=rollout_id, attempt=attempt
            )
        self.stats.count_request((key.task, key.rollout))
        fault = self._fault_for(task_input, key, where="task.task_input")
        if fault is not None:
            return await inject(request, fault)
        reply: dict[str, Any] = {keys.EPISODE_ID: episode_id, keys.TASK_ID: task[keys.TASK_ID]}
        if task_input.get("force_failure"):
            reason, terminal = _forced_failure(task_input)
            reply[keys.FAILURE] = _failure(reason, terminal=terminal, kind="forced", stage="agent")
            return web.json_response(reply)
        try:
            reply[keys.RESULT] = await self.solve(task_input, key, where="task.task_input")
        except InputError as exc:
            reply[keys.FAILURE] = _failure(
                f"bad task input: {exc}", terminal=True, kind="bad_task", stage="admission"
            )
        except ServerError as exc:
            reply[keys.FAILURE] = _failure(str(exc), terminal=False, kind="policy_model_error", stage="agent")
        return web.json_response(reply)

    def _fault_for(self, row: Mapping[str, Any], key: RolloutKey, *, where: str) -> Fault | None:
        fault = row_fault(row, key.attempt, where=where)
        if fault is None:
            fault = self.faults.choose(key)
        if fault is not None:
            self.stats.count_fault(fault.kind)
        return fault

    async def solve(self, row: Mapping[str, Any], key: RolloutKey, *, where: str) -> dict[str, Any]:
        """Answer one rollout: the flat result ``{responses_create_params, response, reward, ...}``.

        Raises:
            InputError: the row has no usable ``responses_create_params`` or ``difficulty``.
            ServerError: the real policy model (``policy_base_url``) failed.
        """
        params = row.get(keys.RESPONSES_CREATE_PARAMS)
        if not isinstance(params, dict) or keys.INPUT not in params:
            raise InputError(
                f"{where}.responses_create_params = {params!r:.120} is not an object with 'input'"
            )
        expected_raw = row.get("expected_answer")
        expected = None if expected_raw is None else str(expected_raw).strip()
        difficulty = row.get("difficulty", 0.0)
        if (
            isinstance(difficulty, bool)
            or not isinstance(difficulty, int | float)
            or not 0 <= difficulty <= 1
        ):
            raise InputError(f"{where}.difficulty = {difficulty!r} is not a number in [0, 1]")
        seed = row_seed(params)
        question = question_text(params)
        started = time.perf_counter()
        if self.policy_base_url is not None and self._session is not None:
            response, text = await call_model(
                self._session, self.policy_base_url, params, model=self.policy_model
            )
            answer = extract_answer(text)
        else:
            delay_s = self.policy.latency_s(key, seed)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            said = self.policy.answer(
                question=question, expected_answer=expected, difficulty=float(difficulty), key=key, seed=seed
            )
            digest = hashlib.sha256(f"{self.name}|{key.label()}|{seed}".encode()).hexdigest()[:24]
            response = build_response(said, response_id=digest, model=self.model_name)
            answer = said.answer
        latency_ms = (time.perf_counter() - started) * 1000.0
        correct = answer is not None and expected is not None and answer.strip() == expected
        result: dict[str, Any] = {
            keys.RESPONSES_CREATE_PARAMS: params,
            keys.RESPONSE: response,
            keys.REWARD: 1.0 if correct else 0.0,
            "expected_answer": expected,
            "extracted_answer": answer,
        }
        if self.capture_dir is not None:
            result[MODEL_CALL_CAPTURE_PATH] = await self._write_capture(
                self.capture_dir, key, params, response, latency_ms
            )
        return result

    async def _write_capture(
        self,
        capture_dir: Path,
        key: RolloutKey,
        params: Mapping[str, Any],
        response: Mapping[str, Any],
        latency_ms: float,
    ) -> str:
        """Write this rollout's model-call capture (one call: the policy's) and return its path."""
        label = _UNSAFE_FILE_CHARS.sub("_", f"{self.name}-{key.label()}")
        usage = response.get(keys.USAGE)
        usage = usage if isinstance(usage, Mapping) else {}
        cached = usage.get("input_tokens_details") or {}
        reasoning = usage.get("output_tokens_details") or {}
        token_stats = {
            "prompt_tokens": usage.get("input_tokens"),
            "cached_tokens": cached.get("cached_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "reasoning_tokens": reasoning.get("reasoning_tokens"),
        }
        capture = {
            "rollout": key.label(),
            "server": self.name,
            "model_calls": [
                {
                    "model_call_id": f"{label}-0",
                    "model_ref": response.get("model"),
                    "response_id": response.get("id"),
                    "latency_ms": latency_ms,
                    "token_stats": {k: v for k, v in token_stats.items() if isinstance(v, int)},
                    "request": dict(params),
                    "response": dict(response),
                }
            ],
        }
        path = capture_dir / f"{label}.json"
        data = json.dumps(capture).encode()
        try:
            await asyncio.to_thread(capture_dir.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(atomic_write_bytes, path, data)
        except OSError as exc:
            raise ServerError(f"cannot write the model-call capture {path}: {exc}") from exc
        return str(path)


def _index(value: object) -> int | str:
    return value if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _attempt(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _forced_failure(row: Mapping[str, Any]) -> tuple[str, bool]:
    value = row.get("force_failure")
    reason = value if isinstance(value, str) else "forced failure (row field force_failure)"
    return reason, bool(row.get("force_failure_terminal", True))


def _failure(reason: str, *, terminal: bool, kind: str, stage: str) -> dict[str, Any]:
    return {
        keys.FAILURE_REASON: reason[:2000],
        keys.FAILURE_TERMINAL_FIELD: terminal,
        keys.FAILURE_KIND: kind,
        keys.FAILURE_STAGE_FIELD: stage,
    }
