"""The protocol's vocabulary: wire key names and failure classes.

Every key gym_ray reads or writes on a row or a result is named here once, so a typo is an
``AttributeError`` at import time instead of a silently missing field at run time. Names follow
PROTOCOL.md (sections 3 and 5).
"""

from __future__ import annotations

from typing import Final

# --- row identity -----------------------------------------------------------------------------
TASK_INDEX: Final = "_ng_task_index"
ROLLOUT_INDEX: Final = "_ng_rollout_index"
ATTEMPT_INDEX: Final = "_ng_attempt_index"
ROLLOUT_ID: Final = "_ng_rollout_id"
ENVIRONMENT_SERVER: Final = "_ng_environment_server"
TASK_ID_STAMP: Final = "_ng_task_id"
RUN_ID: Final = "_ng_run_id"
#: The policy version a streamed rollout was admitted under (on its row, result and recorded line).
POLICY_VERSION: Final = "_ng_policy_version"

# --- row fields ---------------------------------------------------------------------------------
RESPONSES_CREATE_PARAMS: Final = "responses_create_params"
AGENT_REF: Final = "agent_ref"
TASK_SOURCE: Final = "task_source"
SKILLS_REF: Final = "skills_ref"
INPUT: Final = "input"
METADATA: Final = "metadata"
EXTRA_BODY: Final = "extra_body"

# --- materialized task rows and the episode envelope ---------------------------------------------
TASK_ID: Final = "task_id"
TASKSET: Final = "taskset"
TASK_INPUT: Final = "task_input"
EPISODE_ID: Final = "episode_id"
EPISODE_ROLLOUT_ID: Final = "rollout_id"
EPISODE_ATTEMPT: Final = "attempt"
TASK: Final = "task"
RESULT: Final = "result"
FAILURE: Final = "failure"
FAILURE_REASON: Final = "failure_reason"
FAILURE_TERMINAL_FIELD: Final = "terminal"
FAILURE_KIND: Final = "failure_kind"
FAILURE_STAGE_FIELD: Final = "stage"

# --- results ------------------------------------------------------------------------------------
REWARD: Final = "reward"
RESPONSE: Final = "response"
USAGE: Final = "usage"
INCOMPLETE_DETAILS: Final = "incomplete_details"

# --- collector-private keys (a server must not send them; see RESERVED_RESULT_KEYS) ---------------
FAILURE_CLASS: Final = "_ng_failure_class"
FAILURE_TERMINAL: Final = "_ng_failure_terminal"
NO_PERSIST: Final = "_ng_no_persist"
DISPATCH_DRAINED: Final = "_ng_dispatch_drained"
FAILURE_TYPE: Final = "_ng_failure_type"
FAILURE_MESSAGE: Final = "_ng_failure_message"
FAILURE_HTTP_STATUS: Final = "_ng_failure_http_status"
FAILURE_RESPONSE_BODY: Final = "_ng_failure_response_body"
FAILURE_STAGE: Final = "_ng_failure_stage"
FAILURE_PARTIAL_RESPONSE: Final = "_ng_failure_partial_response"
#: ``/run`` requests the server may have seen for this attempt (the engine's resends included).
FAILURE_REQUESTS: Final = "_ng_failure_requests"
#: What each of those requests met, in order (``"timeout"``, ``"broken"``, ``"http_502"``, ...).
FAILURE_REQUEST_ERRORS: Final = "_ng_failure_request_errors"
RESULT_TYPE: Final = "_ng_result_type"
NG_TRAJECTORY: Final = "ng_trajectory"
NG_PERF: Final = "ng_perf"
NG_MODEL_CALL_CAPTURE: Final = "ng_model_call_capture"
NG_AGENT_OBSERVATIONS: Final = "ng_agent_observations"
ERROR_MESSAGE: Final = "error_message"
RUN_ERROR: Final = "run_error"

FAILURE_PREFIX: Final = "_ng_failure_"
PRIVATE_PREFIX: Final = "_ng_"

#: Private keys a server may legitimately return on a 200 reply to report a handled failure.
SERVER_ALLOWED_PRIVATE_KEYS: Final = frozenset({FAILURE_CLASS, FAILURE_TERMINAL, NO_PERSIST})

#: Non-underscore keys only the collector writes.
COLLECTOR_OWNED_KEYS: Final = frozenset({NG_TRAJECTORY, NG_PERF, NG_MODEL_CALL_CAPTURE})

#: Identity keys copied from a row onto what is recorded (never onto what run_examples returns).
RECORDED_IDENTITY_KEYS: Final = (
    TASK_INDEX,
    ROLLOUT_INDEX,
    AGENT_REF,
    TASK_SOURCE,
    SKILLS_REF,
    ATTEMPT_INDEX,
    ROLLOUT_ID,
)

#: Fields stripped from a result before it is sent to /aggregate_metrics.
HEAVY_RESULT_KEYS: Final = (
    RESPONSE,
    RESPONSES_CREATE_PARAMS,
    NG_TRAJECTORY,
    NG_MODEL_CALL_CAPTURE,
    NG_AGENT_OBSERVATIONS,
)
#: Parts of ``response`` kept for aggregation.
KEPT_RESPONSE_KEYS: Final = (USAGE, INCOMPLETE_DETAILS)

# --- server types -------------------------------------------------------------------------------
RESPONSES_API_MODELS: Final = "responses_api_models"
RESOURCES_SERVERS: Final = "resources_servers"
RESPONSES_API_AGENTS: Final = "responses_api_agents"
ENVIRONMENT_SERVERS: Final = "environment_servers"
SERVER_TYPES: Final = (RESPONSES_API_MODELS, RESOURCES_SERVERS, RESPONSES_API_AGENTS, ENVIRONMENT_SERVERS)

# --- top-level config keys ----------------------------------------------------------------------
HEAD_SERVER: Final = "head_server"
ENVIRONMENT_SERVER_ROUTES: Final = "environment_server_routes"
ENVIRONMENT_ROUTING_MODE: Final = "environment_routing_mode"
ENVIRONMENT_SERVER_NAME: Final = "environment_server_name"
AGENT_MAP: Final = "agent_map"
ALLOW_UNSUPPORTED_PAIRING: Final = "allow_unsupported_pairing"
DEFAULT_KEY: Final = "_default"
ALLOWED_AGENTS: Final = "allowed_agents"
DATASETS: Final = "datasets"
AGENT_SERVER: Final = "agent_server"
RESOURCES_SERVER: Final = "resources_server"
MODEL_SERVER: Final = "model_server"

ROUTING_AGENT: Final = "agent"
ROUTING_LEGACY: Final = "legacy"
ROUTING_TASKSET: Final = "taskset"
ROUTING_MODES: Final = (ROUTING_AGENT, ROUTING_LEGACY, ROUTING_TASKSET)


class FailureClass:
    """Values of ``_ng_failure_class``."""

    AGENT_RUN_ERROR: Final = "agent_run_error"
    AGENT_REQUEST_FAILED: Final = "agent_request_failed"
    ENVIRONMENT_SERVER_FAILED: Final = "environment_server_failed"
    CANCELLED: Final = "cancelled"
    KILL_SHAPED: Final = "kill_shaped"
    TIMEOUT_EXCEEDED: Final = "timeout_exceeded"
    JUDGE_FAILED: Final = "judge_failed"
    SKIPPED: Final = "skipped"
    INVALID_RESULT: Final = "invalid_result"

    ALL: Final = frozenset(
        {
            AGENT_RUN_ERROR,
            AGENT_REQUEST_FAILED,
            ENVIRONMENT_SERVER_FAILED,
            CANCELLED,
            KILL_SHAPED,
            TIMEOUT_EXCEEDED,
            JUDGE_FAILED,
            SKIPPED,
            INVALID_RESULT,
        }
    )


#: HTTP statuses that mean "the request did not reach a working server" (agent_request_failed).
GATEWAY_STATUSES: Final = frozenset({429, 502, 503, 504})

#: What a head server publishes in place of a secret value (a client without the head's token sees this).
REDACTED: Final = "<redacted>"

#: Rollout id pattern for an explicit ``_ng_rollout_id``.
ROLLOUT_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def is_reserved_result_key(key: str) -> bool:
    """True when a server must not send ``key`` on a result (PROTOCOL.md section 3)."""
    if key in SERVER_ALLOWED_PRIVATE_KEYS:
        return False
    return key.startswith(PRIVATE_PREFIX) or key in COLLECTOR_OWNED_KEYS


def default_rollout_id(task_index: int, rollout_index: int, attempt_index: int = 0) -> str:
    """The default rollout id: ``"<task>-<rollout>"``, plus ``-a<n>`` on a retry attempt."""
    base = f"{task_index}-{rollout_index}"
    return f"{base}-a{attempt_index}" if attempt_index else base
