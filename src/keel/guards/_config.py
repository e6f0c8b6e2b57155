"""The limits and thresholds the engine enforces on every run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Fallback", "GuardConfig"]

Fallback = Literal["ask_user", "raise"]
"""What a run does when it cannot go on: end with a clean message to the user, or raise."""


class GuardConfig(BaseModel):
    """Hard limits and guard thresholds for one run (the seed values are the defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(
        default=20, ge=1, description="Most model calls in one run; the run stops at the limit."
    )
    run_timeout_s: float = Field(
        default=300.0, gt=0, description="Wall-clock limit for the whole run, tools included."
    )
    model_timeout_s: float = Field(
        default=60.0, gt=0, description="Wall-clock limit for one model call."
    )
    tool_timeout_s: float = Field(
        default=30.0, gt=0, description="Per-call limit for tools that declare no timeout."
    )
    max_output_chars: int = Field(
        default=4000, ge=1, description="Tool output shown to the model is cut at this length."
    )
    max_tool_retries: int = Field(
        default=2,
        ge=0,
        description=(
            "Failed calls of one tool in a row allowed after the first failure; one more "
            "failure and the run takes its fallback."
        ),
    )
    max_output_retries: int = Field(
        default=2,
        ge=0,
        description=(
            "Answers that fail the output type (``output_type``) the model may correct, each "
            "told exactly which fields are wrong; one more and the run ends invalid_output."
        ),
    )
    max_model_failures: int = Field(
        default=2,
        ge=1,
        description=(
            "Model calls in a row that time out, fail, or return an unusable reply (empty, "
            "cut off) before the run takes its fallback."
        ),
    )
    loop_window: int = Field(
        default=5, ge=2, description="How many recent tool calls the loop detector looks at."
    )
    loop_max_repeats: int = Field(
        default=2,
        ge=1,
        description="The same tool with the same arguments more often than this in the window "
        "is a loop.",
    )
    detect_oscillation: bool = Field(
        default=True, description="Treat an A-B-A-B pattern of calls as a loop."
    )
    max_same_error: int = Field(
        default=2,
        ge=2,
        description="The same error this many times in the window is a loop.",
    )
    max_steps_without_progress: int = Field(
        default=6,
        ge=2,
        description=(
            "Steps in a row whose state fingerprint did not change before it counts as a loop "
            "(only with a state fingerprint callback)."
        ),
    )
    fallback: Fallback = Field(
        default="ask_user",
        description=(
            "When the run cannot go on (limit, loop, retries spent): 'ask_user' ends it with a "
            "clean message and the typed error on the result; 'raise' raises the typed error."
        ),
    )
