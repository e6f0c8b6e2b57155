"""Every OpenTelemetry attribute name and value keel's trace export uses, in one place.

Names follow the OpenTelemetry semantic conventions for generative AI (``gen_ai.*``, status:
development) and the general ``error.type``; keel-specific details use the ``keel.*`` namespace.
When the conventions rename an attribute, this module is the only one to change.
"""

from __future__ import annotations

__all__ = [
    "ERROR_TYPE",
    "GEN_AI_AGENT_NAME",
    "GEN_AI_CONVERSATION_ID",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_TOOL_CALL_ARGUMENTS",
    "GEN_AI_TOOL_CALL_ID",
    "GEN_AI_TOOL_CALL_RESULT",
    "GEN_AI_TOOL_NAME",
    "GEN_AI_TOOL_TYPE",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "KEEL_ATTEMPT",
    "KEEL_BUDGET",
    "KEEL_LATENCY_MS",
    "KEEL_RAW_OUTPUT",
    "KEEL_RUN_ID",
    "KEEL_RUN_STATUS",
    "KEEL_STATE_VERSION",
    "KEEL_STEP_ID",
    "KEEL_STEP_KIND",
    "KEEL_STEP_NAME",
    "KEEL_TENANT_ID",
    "KEEL_TTFT_MS",
    "KEEL_USER_ID",
    "OP_CHAT",
    "OP_EXECUTE_TOOL",
    "OP_INVOKE_AGENT",
    "TRACER_NAME",
]

TRACER_NAME = "keel"
"""Instrumentation scope name of keel's spans."""

# --- gen_ai.* (OpenTelemetry GenAI semantic conventions) ----------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
ERROR_TYPE = "error.type"

# --- well-known values of gen_ai.operation.name -------------------------------------------
OP_CHAT = "chat"
OP_EXECUTE_TOOL = "execute_tool"
OP_INVOKE_AGENT = "invoke_agent"

# --- keel.* ---------------------------------------------------------------------------------
KEEL_RUN_ID = "keel.run.id"
KEEL_RUN_STATUS = "keel.run.status"
KEEL_USER_ID = "keel.user.id"
KEEL_TENANT_ID = "keel.tenant.id"
KEEL_STEP_ID = "keel.step.id"
KEEL_STEP_KIND = "keel.step.kind"
KEEL_STEP_NAME = "keel.step.name"
KEEL_ATTEMPT = "keel.step.attempt"
KEEL_LATENCY_MS = "keel.step.latency_ms"
KEEL_TTFT_MS = "keel.step.time_to_first_token_ms"
KEEL_STATE_VERSION = "keel.state.version"
KEEL_BUDGET = "keel.context.budget"
KEEL_RAW_OUTPUT = "keel.model.raw_output"
