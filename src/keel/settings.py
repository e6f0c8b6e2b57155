"""All of keel's configuration, validated in one place.

Values come from, highest priority first: ``KEEL_*`` environment variables, then a TOML config
file (``KEEL_CONFIG``, else ``keel.toml`` in the platform's config directory, if it exists), then
the defaults below. The default data directory follows the platform's conventions
(``~/.local/share/keel`` on Linux) and holds the default SQLite database, ``keel.db``.
"""

from __future__ import annotations

import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from keel._urls import DatabaseURL, parse_database_url
from keel.errors import ConfigError

__all__ = [
    "MAX_BUSY_TIMEOUT_MS",
    "Settings",
    "default_config_file",
    "default_pii_key_file",
    "load_settings",
    "validation_problems",
]

_APP = "keel"

MAX_BUSY_TIMEOUT_MS = 3_600_000
"""The longest busy timeout accepted: an hour. Longer is a typo, and SQLite's own limit is a
32-bit number of milliseconds."""

_file_values: ContextVar[dict[str, Any] | None] = ContextVar("keel_config_file", default=None)


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The config file's values, read by ``load_settings`` before validation."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_file_values.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_values.get() or {})


def default_config_file() -> Path:
    """Where keel looks for its TOML config file when ``KEEL_CONFIG`` is not set."""
    return Path(platformdirs.user_config_dir(_APP)) / "keel.toml"


def default_pii_key_file() -> Path:
    """Where the embedded database's PII master key is kept when none is configured: beside
    the config file, outside the database it opens (a copy of ``keel.db`` alone opens
    nothing)."""
    return Path(platformdirs.user_config_dir(_APP)) / "pii.key"


class Settings(BaseSettings):
    """keel's settings. Every field can be set as ``KEEL_<FIELD>`` or in the config file."""

    model_config = SettingsConfigDict(env_prefix="KEEL_", extra="forbid", frozen=True)

    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir(_APP)),
        description="Directory for the embedded database and local state.",
    )
    database: str | None = Field(
        default=None,
        description=(
            "Database URL: sqlite:///PATH or postgresql://... Defaults to keel.db in data_dir."
        ),
    )
    redis_url: str | None = Field(default=None, description="Redis URL for the Redis backends.")
    model: str = Field(
        default="local:smollm2",
        description="Default model spec: local:smollm2, openai:gpt-4o-mini, "
        "openai-compatible:MODEL@http://host:port/v1, scripted:...",
    )
    local_max_answer_tokens: int = Field(
        default=384,
        gt=0,
        description=(
            "Most tokens one answer of a bundled local model (local:*) may take: a longer one "
            "ends there, reported cut (reply.truncated), instead of rambling on for minutes. "
            "A spec can set its own: local:smollm2?max_answer_tokens=256."
        ),
    )
    embedder: str = Field(
        default="local:all-minilm-l6-v2", description="Default embedding model spec."
    )
    openai_base_url: str | None = Field(
        default=None, description="Base URL for OpenAI-compatible endpoints."
    )
    openai_api_key: SecretStr | None = Field(
        default=None, description="API key for OpenAI-compatible endpoints."
    )
    pii_key: SecretStr | None = Field(
        default=None,
        description=(
            "The PII vault's master key (32 bytes, base64 or hex; `keel privacy new-key`): "
            "with it, masked values are kept sealed so tools can use them. Unset: the embedded "
            "SQLite database uses a key file keel creates once in the config directory "
            "(pii.key, mode 0600); a PostgreSQL database has no vault (a warning says so) and "
            "is refused if it already holds one."
        ),
    )
    pii_key_file: Path | None = Field(
        default=None,
        description="A file holding the PII vault's master key (used when pii_key is unset).",
    )
    pii_key_previous: SecretStr | None = Field(
        default=None,
        description=(
            "The master key a key rotation is moving away from, while it is under way: data "
            "keys still wrapped by it are opened with it (never used to wrap)."
        ),
    )
    pii_key_previous_file: Path | None = Field(
        default=None,
        description="A file holding pii_key_previous (used when pii_key_previous is unset).",
    )
    pii_vault: bool = Field(
        default=True,
        description=(
            "Keep masked values in the PII vault (off: masking only, values dropped, no key "
            "created or required)."
        ),
    )
    busy_timeout_ms: int = Field(
        default=5000,
        ge=0,
        le=MAX_BUSY_TIMEOUT_MS,
        description="How long SQLite waits on a locked database, in ms (at most one hour).",
    )
    carry_out_every_s: float = Field(
        default=2.0,
        ge=0.05,
        le=3600.0,
        description=(
            "How often each `keel serve` worker carries out approval decisions made elsewhere "
            "(`keel approvals approve`), in seconds (0.05 to 3600)."
        ),
    )
    memory_retention: dict[str, dict[str, dict[str, float]]] = Field(
        default_factory=dict,
        description=(
            "Memory retention by tenant id (a key of one asterisk: every tenant without its "
            "own): for each kind of memory (episodic, semantic, procedural) a rule of "
            "max_age_days and max_count per user, as JSON (see the deployment guide); applied "
            "by `keel memory prune` and `keel serve`."
        ),
    )
    memory_prune_every_s: float = Field(
        default=3600.0,
        ge=0,
        description=(
            "How often each `keel serve` worker applies memory_retention, in seconds (0: never; "
            "nothing runs while memory_retention is empty)."
        ),
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        description=(
            "Replicas each state write on Redis waits for (WAIT) before it is acknowledged; "
            "0: acknowledged once the primary has it (a failover may lose the last moments)."
        ),
    )
    redis_wait_timeout_ms: int = Field(
        default=1000,
        ge=1,
        description="How long a state write waits for those replicas, in ms; fewer fail it.",
    )
    redis_durability: Literal["warn", "require", "off"] = Field(
        default="warn",
        description=(
            "What a Redis holding state without an fsynced append-only file (appendonly yes, "
            "appendfsync always) or with fewer replicas than redis_wait_replicas gets at "
            "start-up: warn (a log line), require (refused) or off (not checked)."
        ),
    )
    postgres_pool_size: int = Field(
        default=10,
        ge=1,
        description=(
            "Most connections an agent opens to a PostgreSQL database (its stores share them; "
            "async calls have as many again on their event loop)."
        ),
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Explicit arguments beat the environment, which beats the config file.
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))

    @field_validator("data_dir", mode="after")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("pii_key_file", "pii_key_previous_file", mode="after")
    @classmethod
    def _expand_key_file(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @field_validator("database", mode="after")
    @classmethod
    def _known_database(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must not be empty (leave it unset for the default SQLite file)")
        try:
            parse_database_url(value, kinds=("sqlite", "postgres"))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("redis_url", mode="after")
    @classmethod
    def _redis(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            parse_database_url(value, kinds=("redis",))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return value

    @property
    def database_url(self) -> str:
        """The database URL in effect: ``database`` or the SQLite file in ``data_dir``."""
        if self.database:
            return self.database
        return f"sqlite:///{self.data_dir / 'keel.db'}"

    @property
    def parsed_database(self) -> DatabaseURL:
        """``database_url``, parsed (its engine, the driver's URL, the SQLite path)."""
        return parse_database_url(self.database_url, kinds=("sqlite", "postgres"))

    @property
    def sqlite_path(self) -> Path | None:
        """The SQLite file behind ``database_url``, or None for a server database."""
        return self.parsed_database.path


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # A [keel] table is accepted so the file can be shared with other tools.
    section = data.get("keel", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [keel] must be a table")
    return section


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Load and validate settings from the environment, the config file and ``overrides``.

    Raises:
        ConfigError: the config file is unreadable or a value is invalid (one line per field).
    """
    explicit = config_file or os.environ.get("KEEL_CONFIG")
    path = Path(explicit).expanduser() if explicit else default_config_file()
    file_values: dict[str, Any] = {}
    if explicit or path.exists():
        file_values = _read_config_file(path)
    token = _file_values.set(file_values)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {validation_problems(exc, 'settings')}") from exc
    except SettingsError as exc:
        # A KEEL_* variable of a table or list field that does not parse as JSON: pydantic
        # -settings raises this before validation, naming the field in its message.
        field_named = re.search(r'field "(\w+)"', str(exc))
        variable = f"KEEL_{field_named[1].upper()}" if field_named else "a KEEL_* variable"
        reason = exc.__cause__ or exc
        raise ConfigError(f"invalid settings: {variable} is not valid JSON ({reason})") from exc
    finally:
        _file_values.reset(token)


def validation_problems(exc: ValidationError, whole: str) -> str:
    """One line naming each field pydantic refused and why (``whole``: what a problem that is
    not about one field is about)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or whole}: "
        f"{error['msg'].removeprefix('Value error, ')}"
        for error in exc.errors()
    )
