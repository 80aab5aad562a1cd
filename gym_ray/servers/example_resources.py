"""``example_resources``: the reference resources server (verifier) of the bundled demo.

Routes: ``POST /verify`` (``{responses_create_params, response, expected_answer?, ...}`` -> the body plus
``reward`` and ``extracted_answer``; reward 1.0 when the answer in the response's output text equals
``expected_answer``), ``POST /seed_session`` (-> ``{}``), ``POST /aggregate_metrics`` (``metrics.py``),
``GET /_stats`` and the health routes. Stateless; handlers run on the server's event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gym_ray import keys
from gym_ray.servers import _web
from gym_ray.servers.faults import FaultConfig
from gym_ray.servers.policy import extract_answer
from gym_ray.servers.stats import StatsRecorder

IMPLEMENTATION = "example_resources"


class ExampleResourcesServer:
    """One ``example_resources`` instance.

    Args:
        name: the instance name.
        fields: the implementation's config fields (``faults.aggregate_error_status`` is honoured).

    Raises:
        ConfigError: a bad ``faults`` mapping.
    """

    def __init__(self, name: str, fields: Mapping[str, Any]) -> None:
        self.name = name
        self.server_type = keys.RESOURCES_SERVERS
        self.faults = FaultConfig.from_mapping(
            fields.get("faults"), key_path=f"{name}.{keys.RESOURCES_SERVERS}.{IMPLEMENTATION}.faults"
        )
        self.stats = StatsRecorder()

    def make_app(self) -> web.Application:
        """A fresh aiohttp application serving this instance."""
        app = web.Application(client_max_size=_web.MAX_BODY_BYTES)
        _web.add_health_routes(app)
        app.router.add_post("/verify", self._handle_verify)
        app.router.add_post("/seed_session", self._handle_seed_session)
        app.router.add_post("/aggregate_metrics", self._handle_aggregate)
        app.router.add_get("/_stats", self._handle_stats)
        return app

    async def _handle_verify(self, request: web.Request) -> web.Response:
        self.stats.verify_calls += 1
        body = await _web.read_json_object(request)
        if isinstance(body, web.Response):
            return body
        return web.json_response(verify(body))

    async def _handle_seed_session(self, request: web.Request) -> web.Response:
        body = await _web.read_json_object(request)
        if isinstance(body, web.Response):
            return body
        return web.json_response({})

    async def _handle_aggregate(self, request: web.Request) -> web.Response:
        return await _web.handle_aggregate_metrics(
            request, self.stats, error_status=self.faults.aggregate_error_status
        )

    async def _handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.snapshot().to_json())


def verify(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/verify`` reply: ``body`` plus ``reward`` (1.0 iff the output's answer equals
    ``expected_answer``) and ``extracted_answer`` (None when the response has no output text)."""
    response = body.get(keys.RESPONSE)
    texts: list[str] = []
    if isinstance(response, Mapping):
        for item in response.get("output") or []:
            if isinstance(item, Mapping) and item.get("type") == "message":
                for part in item.get("content") or []:
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                        texts.append(part["text"])
    answer = extract_answer("\n".join(texts)) if texts else None
    expected = body.get("expected_answer")
    correct = answer is not None and expected is not None and answer.strip() == str(expected).strip()
    return {**body, keys.REWARD: 1.0 if correct else 0.0, "extracted_answer": answer}
