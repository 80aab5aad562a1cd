"""The reference environment's policy: a deterministic simulated solver, or a real Responses API model.

The simulated policy answers a task correctly unless a seeded draw falls below
``p_wrong = difficulty * (1 - skill)``. The draw is a hash of (server seed, row seed, task index, rollout
index, attempt), so a replay of the same rollout gives the same answer, and tests know the outcome:
difficulty 0 always answers right, difficulty 1 with skill 0 always answers wrong. ``skill`` can change
at run time (``POST /policy``); everything else is fixed at construction.

Concurrency: one ``SimulatedPolicy`` is shared by every request of one server on one event loop; reads
and writes of ``skill`` happen on that loop only.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gym_ray import keys
from gym_ray.errors import ConfigError, ServerConnectionError, ServerHTTPError, ServerResponseError

_ARITHMETIC = re.compile(r"(-?\d+)\s*([+\-*x×])\s*(-?\d+)")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*(.+?)\s*\.?\s*$", re.IGNORECASE | re.DOTALL)
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class RolloutKey:
    """Identity of one rollout attempt, as a server sees it (ints for flat rows, strings if custom)."""

    task: int | str
    rollout: int | str
    attempt: int = 0

    def label(self) -> str:
        """``"<task>-<rollout>"`` plus ``-a<n>`` on a retry attempt."""
        base = f"{self.task}-{self.rollout}"
        return f"{base}-a{self.attempt}" if self.attempt else base


@dataclass(frozen=True)
class PolicyAnswer:
    """What the policy said: the full output text, the answer in it, and token counts."""

    text: str
    answer: str | None
    input_tokens: int
    output_tokens: int


def unit_draw(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts`` (sha256 of their ``|``-joined text)."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def row_seed(responses_create_params: Mapping[str, Any]) -> int | None:
    """The ``seed`` in ``responses_create_params.metadata.extra_body`` (a JSON string), if any."""
    metadata = responses_create_params.get(keys.METADATA)
    if not isinstance(metadata, Mapping):
        return None
    extra = metadata.get(keys.EXTRA_BODY)
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    if isinstance(extra, Mapping):
        seed = extra.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            return seed
    return None


def question_text(responses_create_params: Mapping[str, Any]) -> str:
    """The last user message's text in ``input`` (a string input is the question itself)."""
    items = responses_create_params.get(keys.INPUT)
    if isinstance(items, str):
        return items
    text = ""
    if isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping) and item.get("role", "user") == "user":
                text = _content_text(item.get("content"))
    return text


def solve_arithmetic(question: str) -> str | None:
    """The exact answer to ``"What is A op B?"`` (op in + - * x), or None when it is not such a question."""
    m = _ARITHMETIC.search(question)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op == "+":
        return str(a + b)
    if op == "-":
        return str(a - b)
    return str(a * b)


def extract_answer(text: str) -> str | None:
    """The answer in a model's output: after "answer is", else the last number, else the stripped text."""
    m = _ANSWER_IS.search(text)
    if m is not None:
        return m.group(1).strip()
    numbers = _LAST_NUMBER.findall(text)
    if numbers:
        return str(numbers[-1])
    stripped = text.strip()
    return stripped or None


def count_tokens(text: str) -> int:
    """A deterministic token count: whitespace-separated words."""
    return len(text.split())


class SimulatedPolicy:
    """Deterministic simulated solver with per-task difficulty, a run-time ``skill`` and latency.

    Args:
        seed: the server's seed; two servers with different seeds make different mistakes.
        skill: 0..1; ``p_wrong = difficulty * (1 - skill)``.
        latency_ms: base latency of one answer; 0 with ``latency_jitter_ms`` 0 never sleeps.
        latency_jitter_ms: extra latency drawn uniformly in ``[0, jitter)`` per rollout attempt.
    """

    def __init__(
        self, *, seed: int = 0, skill: float = 0.0, latency_ms: float = 0.0, latency_jitter_ms: float = 0.0
    ) -> None:
        self.seed = seed
        self.latency_ms = latency_ms
        self.latency_jitter_ms = latency_jitter_ms
        self._skill = check_skill(skill)

    @property
    def skill(self) -> float:
        """Current skill in [0, 1]."""
        return self._skill

    @skill.setter
    def skill(self, value: float) -> None:
        self._skill = check_skill(value)

    def p_wrong(self, difficulty: float) -> float:
        """Probability of a wrong answer for a task of this difficulty."""
        return min(1.0, max(0.0, difficulty)) * (1.0 - self._skill)

    def answer(
        self,
        *,
        question: str,
        expected_answer: str | None,
        difficulty: float,
        key: RolloutKey,
        seed: int | None = None,
    ) -> PolicyAnswer:
        """Answer one rollout attempt; the same arguments always give the same answer.

        The right answer is ``expected_answer`` (else the arithmetic solution of the question); a wrong
        answer is the right one shifted by a nonzero seeded amount (or ``"I don't know"``).
        """
        right = expected_answer if expected_answer is not None else solve_arithmetic(question)
        u = unit_draw("answer", self.seed, seed, key.task, key.rollout, key.attempt)
        if right is not None and u >= self.p_wrong(difficulty):
            answer = right
        else:
            answer = _wrong_answer(
                right, unit_draw("shift", self.seed, seed, key.task, key.rollout, key.attempt)
            )
        text = f"The answer is {answer}."
        return PolicyAnswer(
            text=text, answer=answer, input_tokens=count_tokens(question), output_tokens=count_tokens(text)
        )

    def latency_s(self, key: RolloutKey, seed: int | None = None) -> float:
        """Seconds this attempt takes; exactly 0.0 in instant mode."""
        if self.latency_ms <= 0 and self.latency_jitter_ms <= 0:
            return 0.0
        jitter = self.latency_jitter_ms * unit_draw(
            "latency", self.seed, seed, key.task, key.rollout, key.attempt
        )
        return max(0.0, self.latency_ms + jitter) / 1000.0


def check_skill(value: object) -> float:
    """``value`` as a float in [0, 1], else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"skill = {value!r} is not a number in [0, 1]; pass e.g. 0.5", key="skill")
    return float(value)


def _wrong_answer(right: str | None, u: float) -> str:
    if right is None:
        return "I don't know"
    shift = 1 + int(u * 9)  # 1..9, never 0
    try:
        return str(int(right) + shift)
    except ValueError:
        return f"not {right}"


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return " ".join(str(p) for p in parts if p)
    return ""


def build_response(
    answer: PolicyAnswer, *, response_id: str, model: str, created_at: float | None = None
) -> dict[str, Any]:
    """A NeMo Gym Response object (the capture's shape) whose only output item is the answer message."""
    return {
        "id": f"resp_{response_id}",
        "created_at": float(int(time.time())) if created_at is None else created_at,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "model": model,
        "object": "response",
        "output": [
            {
                "id": f"msg_{response_id}",
                "content": [
                    {"annotations": [], "text": answer.text, "type": "output_text", "logprobs": None}
                ],
                "role": "assistant",
                "status": "completed",
                "type": "message",
                "phase": None,
            }
        ],
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "status": "completed",
        "usage": {
            "input_tokens": answer.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.input_tokens + answer.output_tokens,
        },
        "user": None,
    }


async def call_model(
    session: aiohttp.ClientSession,
    base_url: str,
    responses_create_params: Mapping[str, Any],
    *,
    model: str | None = None,
) -> tuple[dict[str, Any], str]:
    """POST ``{base_url}/responses`` (OpenAI Responses-compatible); returns (the response, its output text).

    Raises:
        ServerConnectionError: no answer from the model server.
        ServerHTTPError: it answered an error status.
        ServerResponseError: its reply is not a JSON object.
    """
    url = base_url.rstrip("/") + "/responses"
    body = dict(responses_create_params)
    if model is not None and body.get("model") is None:
        body["model"] = model
    try:
        async with session.post(url, json=body) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ServerHTTPError(
                    f"policy model at {url} answered HTTP {resp.status}; check policy_base_url and the model",
                    url=url,
                    status=resp.status,
                    body_excerpt=text[:500],
                )
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise ServerConnectionError(
            f"policy model at {url} did not answer ({type(exc).__name__}: {exc}); is policy_base_url right?",
            url=url,
        ) from exc
    try:
        reply = json.loads(text)
    except ValueError as exc:
        raise ServerResponseError(f"policy model at {url} sent non-JSON: {text[:200]!r}", url=url) from exc
    if not isinstance(reply, dict):
        raise ServerResponseError(
            f"policy model at {url} sent a {type(reply).__name__}, not an object", url=url
        )
    out: list[str] = []
    for item in reply.get("output") or []:
        if isinstance(item, Mapping) and item.get("type") == "message":
            out.append(_content_text(item.get("content")))
    return reply, "\n".join(out)
