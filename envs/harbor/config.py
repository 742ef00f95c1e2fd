"""Harbor's task.toml (PyPI `harbor` 0.26, `harbor/models/task/config.py`) as typed frozen dataclasses.

`parse_task_config(data, where)` turns the dict `tomllib` read into a `TaskConfig`: every field Harbor defines,
with its defaults, its renames and deprecations (`version` → `schema_version`; `memory` / `storage` size strings
→ `memory_mb` / `storage_mb`; `allow_internet` → `network_mode`) and its validation rules. `TaskConfig.to_dict()`
is what Harbor's `TaskConfig.model_dump(mode="json")` returns for the same file (the tests compare the two).

Where Harbor's pydantic models accept nonsense this is stricter, and says so in the error: a boolean where a
number or a user is expected (pydantic reads `true` as 1), a non-positive `cpus` / `memory_mb` / `storage_mb`,
a negative `gpus`, a timeout that is not a positive finite number. Unknown keys are ignored, as Harbor does, and
listed in `ParseNotes.unknown` (what `harbor lint` calls `unknown-config-field`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath
from typing import Any

from slime_env.envs.harbor.config_fields import (
    FieldError, ParseNotes, _join, _table, _Section, _str, _opt_str, _number, _seconds, _nonneg_seconds,
    _positive_int, _nonneg_int, _cpus, _bool, _user, _choice, _str_list, _str_map, _list_of, _allowed_hosts,
    _check_network, _size_mb
)

ORG_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*$")
NETWORK_MODES = ("no-network", "public", "allowlist")
VERIFIER_MODES = ("shared", "separate")
OSES = ("linux", "windows")
MCP_TRANSPORTS = ("stdio", "sse", "streamable-http")
REWARD_STRATEGIES = ("mean", "final")
MAIN_SERVICE = "main"


@dataclass(frozen=True, slots=True)
class Author:
    name: str
    email: str | None = None


@dataclass(frozen=True, slots=True)
class PackageInfo:
    """`[task]`: a registry package's name (`org/name`), version, description, authors and keywords."""

    name: str
    version: str | None = None
    description: str = ""
    authors: tuple[Author, ...] = ()
    keywords: tuple[str, ...] = ()

    @property
    def org(self) -> str:
        return self.name.split("/")[0]

    @property
    def short_name(self) -> str:
        return self.name.split("/")[1]


@dataclass(frozen=True, slots=True)
class HealthcheckConfig:
    """Docker HEALTHCHECK-like readiness check run after the environment starts."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


@dataclass(frozen=True, slots=True)
class TpuSpec:
    type: str
    topology: str


@dataclass(frozen=True, slots=True)
class MCPServerConfig:
    """An MCP server offered to the agent (`transport` `http` is read as `streamable-http`)."""

    name: str
    transport: str = "sse"
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ArtifactConfig:
    """A path collected from a container after the run (`source`), stored under `destination`."""

    source: str
    destination: str | None = None
    exclude: tuple[str, ...] = ()
    service: str | None = None


@dataclass(frozen=True, slots=True)
class VerifierCollectConfig:
    """`[[verifier.collect]]`: a command run in a service after the agent, before artifacts are collected."""

    command: str
    service: str = MAIN_SERVICE
    timeout_sec: float = 60.0
    user: str | int | None = None


@dataclass(frozen=True, slots=True)
class EnvironmentConfig:
    """`[environment]` (and `[verifier.environment]`): the container. `network_mode` defaults to `public`;
    `allow_internet` (deprecated) has been applied to `network_mode` and reads None, as in Harbor."""

    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    os: str = "linux"
    cpus: int | float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    gpu_types: tuple[str, ...] | None = None
    tpu: TpuSpec | None = None
    network_mode: str = "public"
    allowed_hosts: tuple[str, ...] | None = None
    mcp_servers: tuple[MCPServerConfig, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    skills_dir: str | None = None
    healthcheck: HealthcheckConfig | None = None
    workdir: str | None = None
    allow_internet: bool | None = None


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """`[agent]`: the agent's timeout (None: none), user (None: the image's USER) and network override."""

    timeout_sec: float | None = None
    user: str | int | None = None
    network_mode: str | None = None
    allowed_hosts: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    """`[verifier]`: timeout, env (`${VAR}` templates resolved from the host at run time), user, where it runs
    (`environment_mode`: None is `separate` when `environment` is set, else `shared`) and collect hooks."""

    timeout_sec: float = 600.0
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | int | None = None
    environment_mode: str | None = None
    environment: EnvironmentConfig | None = None
    collect: tuple[VerifierCollectConfig, ...] = ()
    network_mode: str | None = None
    allowed_hosts: tuple[str, ...] | None = None

    @property
    def mode(self) -> str:
        """The effective mode: `shared` or `separate`."""
        if self.environment_mode is not None:
            return self.environment_mode
        return "separate" if self.environment is not None else "shared"


@dataclass(frozen=True, slots=True)
class SolutionConfig:
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepConfig:
    """`[[steps]]` of a multi-step task."""

    name: str
    agent: AgentConfig = field(default_factory=AgentConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    min_reward: float | Mapping[str, float] | None = None
    healthcheck: HealthcheckConfig | None = None
    artifacts: tuple[str | ArtifactConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """A whole task.toml. `schema_version` is not checked (Harbor accepts any string)."""

    schema_version: str = "1.4"
    task: PackageInfo | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = field(default_factory=SolutionConfig)
    source: str | None = None
    multi_step_reward_strategy: str | None = None
    steps: tuple[StepConfig, ...] | None = None
    artifacts: tuple[str | ArtifactConfig, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Harbor's `TaskConfig.model_dump(mode="json")` of the same file (deprecated and empty-excluded fields
        left out as Harbor leaves them out)."""
        return _dump(self)


def _dump(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        out = {}
        for f in fields(value):
            v = getattr(value, f.name)
            if isinstance(value, EnvironmentConfig) and f.name == "allow_internet":
                continue  # Field(exclude=True) in Harbor
            if isinstance(value, MCPServerConfig) and f.name == "headers" and not v:
                continue  # Field(exclude_if=lambda v: not v)
            out[f.name] = _dump(v)
        return out
    if isinstance(value, Mapping):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def _legacy_size(data: dict, key: str, where: str, notes: ParseNotes) -> None:
    """`memory = "4G"` / `storage = "10G"` (deprecated): popped; a string becomes `<key>_mb` unless that is
    set to another value (an error); a non-string is dropped silently, as Harbor drops it."""
    if key not in data:
        return
    notes.deprecated.append(f"{_join(where, key)} (use {key}_mb)")
    raw = data.pop(key)
    if isinstance(raw, str):
        mb = _size_mb(raw, _join(where, key))
        if f"{key}_mb" in data and data[f"{key}_mb"] != mb:
            raise FieldError(_join(where, key), f"conflicting '{key}' and '{key}_mb' values: {key}={raw!r} "
                                                f"({mb} MB) != {key}_mb={data[f'{key}_mb']!r}")
        data.setdefault(f"{key}_mb", mb)


def _environment(value: Any, where: str, notes: ParseNotes) -> tuple[EnvironmentConfig, bool]:
    """The section and whether `network_mode` was written in it (`allow_internet` yields to it)."""
    data = dict(_table(value, where))
    if data.get("allow_internet") is not None:
        notes.deprecated.append(f"{_join(where, 'allow_internet')} (use network_mode)")
    _legacy_size(data, "memory", where, notes)
    _legacy_size(data, "storage", where, notes)
    s = _Section(data, where, notes)
    explicit_mode = "network_mode" in s.data
    env = EnvironmentConfig(
        build_timeout_sec=s.pop("build_timeout_sec", _seconds, 600.0),
        docker_image=s.pop("docker_image", _opt_str),
        os=s.pop("os", _choice(OSES, lower=True), "linux"),
        cpus=s.pop("cpus", _cpus), memory_mb=s.pop("memory_mb", _positive_int),
        storage_mb=s.pop("storage_mb", _positive_int), gpus=s.pop("gpus", _nonneg_int),
        gpu_types=s.pop("gpu_types", _str_list), tpu=s.pop("tpu", lambda v, w: _tpu(v, w, notes)),
        network_mode=s.pop("network_mode", _choice(NETWORK_MODES), "public"),
        allowed_hosts=s.pop("allowed_hosts", _allowed_hosts),
        mcp_servers=s.pop("mcp_servers", _list_of(lambda v, w: _mcp(v, w, notes)), ()),
        env=s.pop("env", _str_map, {}), skills_dir=s.pop("skills_dir", _opt_str),
        healthcheck=s.pop("healthcheck", lambda v, w: _healthcheck(v, w, notes)),
        workdir=s.pop("workdir", _opt_str), allow_internet=s.pop("allow_internet", _bool))
    s.done()
    _check_network(env.network_mode, env.allowed_hosts, where)
    return env, explicit_mode


def _apply_allow_internet(env: EnvironmentConfig, explicit_mode: bool) -> EnvironmentConfig:
    """Harbor's `handle_deprecated_environment_allow_internet`: true → public, false → no-network, unless
    `network_mode` or `allowed_hosts` is written; the field then reads None."""
    from dataclasses import replace

    mode = env.network_mode
    if env.allow_internet is not None and not explicit_mode and env.allowed_hosts is None:
        mode = "public" if env.allow_internet else "no-network"
    return replace(env, network_mode=mode, allow_internet=None)


def _tpu(value: Any, where: str, notes: ParseNotes) -> TpuSpec:
    s = _Section(value, where, notes)
    if "type" not in s.data or "topology" not in s.data:
        raise FieldError(where, "needs 'type' and 'topology'")
    kind = s.pop("type", _str)
    if not kind:
        raise FieldError(_join(where, "type"), "must not be empty")
    topology = s.pop("topology", _str).strip()
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)+", topology):
        raise FieldError(_join(where, "topology"), f"expected dimensions like '2x4' or '2x2x1', got {topology!r}")
    s.done()
    return TpuSpec(kind, topology)


def _healthcheck(value: Any, where: str, notes: ParseNotes) -> HealthcheckConfig:
    s = _Section(value, where, notes)
    if "command" not in s.data:
        raise FieldError(_join(where, "command"), "is required")
    hc = HealthcheckConfig(command=s.pop("command", _str), interval_sec=s.pop("interval_sec", _seconds, 5.0),
                           timeout_sec=s.pop("timeout_sec", _seconds, 30.0),
                           start_period_sec=s.pop("start_period_sec", _nonneg_seconds, 0.0),
                           start_interval_sec=s.pop("start_interval_sec", _seconds, 5.0),
                           retries=s.pop("retries", _nonneg_int, 3))
    s.done()
    return hc


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_EMBEDDED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SENSITIVE = re.compile(r"(KEY|SECRET|TOKEN(?!S)|PASSWORD|CREDENTIAL|AUTH)", re.IGNORECASE)
_NO_DEFAULT = r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::-)?\}"
_TEMPLATED_CREDENTIAL = re.compile(rf"\s*(?:[A-Za-z]+\s+)?{_NO_DEFAULT}(?:[\s:-]*{_NO_DEFAULT})*\s*")


def _header_value(name: str, value: str, where: str) -> None:
    """Harbor's MCP header rules: no newlines, well-formed `${VAR}` templates, and credentials only as `${VAR}`
    references (never literal, never as a template's default)."""
    if "\r" in value or "\n" in value:
        raise FieldError(where, "must not contain newlines")
    if "${" in _EMBEDDED.sub(" ", value) or any(d and "${" in d for _, d in _EMBEDDED.findall(value)):
        raise FieldError(where, "invalid environment variable template")
    sensitive = bool(_SENSITIVE.search(name)) or name.lower() in ("cookie", "set-cookie")
    if any(d and (sensitive or _SENSITIVE.search(var)) for var, d in _EMBEDDED.findall(value)) or (
            sensitive and value.strip() and not _TEMPLATED_CREDENTIAL.fullmatch(value)):
        raise FieldError(where, "credentials must be ${VAR} references without a default, such as "
                                "'Bearer ${TOKEN}'")


def _mcp(value: Any, where: str, notes: ParseNotes) -> MCPServerConfig:
    s = _Section(value, where, notes)
    if "name" not in s.data:
        raise FieldError(_join(where, "name"), "is required")
    name = s.pop("name", _str)
    transport = s.pop("transport", lambda v, w: _choice(MCP_TRANSPORTS)("streamable-http" if v == "http" else v, w),
                      "sse")
    headers = s.pop("headers", _str_map, {})
    for key, v in headers.items():
        if not _HEADER_NAME.fullmatch(key):
            raise FieldError(_join(_join(where, "headers"), key), "invalid HTTP header name")
        _header_value(key, v, _join(_join(where, "headers"), key))
    server = MCPServerConfig(name=name, transport=transport, url=s.pop("url", _opt_str),
                             command=s.pop("command", _opt_str), args=s.pop("args", _str_list, ()), headers=headers)
    s.done()
    if server.transport in ("sse", "streamable-http") and not server.url:
        raise FieldError(_join(where, "url"), f"is required for transport '{server.transport}'")
    if server.transport == "stdio" and not server.command:
        raise FieldError(_join(where, "command"), "is required for transport 'stdio'")
    if server.transport == "stdio" and server.headers:
        raise FieldError(_join(where, "headers"), "is only supported for HTTP MCP transports")
    return server


_SERVICE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


def _service(value: Any, where: str) -> str:
    v = _str(value, where).strip()
    if not _SERVICE.match(v):
        raise FieldError(where, f"invalid Docker Compose service name {value!r}")
    return v


def _artifact(value: Any, where: str, notes: ParseNotes) -> str | ArtifactConfig:
    if isinstance(value, str):
        _artifact_source(value, where)
        return value
    s = _Section(value, where, notes)
    if "source" not in s.data:
        raise FieldError(_join(where, "source"), "is required")
    art = ArtifactConfig(source=s.pop("source", _str), destination=s.pop("destination", _opt_str),
                         exclude=s.pop("exclude", _str_list, ()), service=s.pop("service", _service))
    s.done()
    _artifact_source(art.source, _join(where, "source"))
    dest = art.destination
    if dest is not None:
        at = _join(where, "destination")
        if dest == "":
            art = ArtifactConfig(art.source, None, art.exclude, art.service)
        elif "\\" in dest:
            raise FieldError(at, f"must use forward slashes, got {dest!r}")
        elif PurePosixPath(dest).is_absolute():
            raise FieldError(at, f"must be a relative path, got {dest!r}")
        elif ".." in PurePosixPath(dest).parts:
            raise FieldError(at, f"must not contain '..' components, got {dest!r}")
        elif dest.rstrip("/") == "manifest.json":
            raise FieldError(at, "'manifest.json' is reserved for the collection manifest")
    if art.service not in (None, MAIN_SERVICE) and not (
            art.source.startswith("/") or re.match(r"^[A-Za-z]:[/\\]", art.source)):
        raise FieldError(_join(where, "source"), f"{art.source!r} collected from service {art.service!r} must be "
                                                 f"an absolute path")
    return art


def _artifact_source(source: str, where: str) -> None:
    if ".." in PurePosixPath(source).parts:
        raise FieldError(where, f"must not contain '..' components, got {source!r}")


def _collect(value: Any, where: str, notes: ParseNotes) -> VerifierCollectConfig:
    s = _Section(value, where, notes)
    if "command" not in s.data:
        raise FieldError(_join(where, "command"), "is required")
    hook = VerifierCollectConfig(command=s.pop("command", _str), service=s.pop("service", _service, MAIN_SERVICE),
                                 timeout_sec=s.pop("timeout_sec", _seconds, 60.0), user=s.pop("user", _user))
    s.done()
    return hook


def _agent(value: Any, where: str, notes: ParseNotes) -> AgentConfig:
    s = _Section(value, where, notes)
    agent = AgentConfig(timeout_sec=s.pop("timeout_sec", _seconds), user=s.pop("user", _user),
                        network_mode=s.pop("network_mode", _choice(NETWORK_MODES)),
                        allowed_hosts=s.pop("allowed_hosts", _allowed_hosts))
    s.done()
    _check_network(agent.network_mode, agent.allowed_hosts, where)
    return agent


def _verifier(value: Any, where: str, notes: ParseNotes) -> VerifierConfig:
    s = _Section(value, where, notes)
    environment = s.pop("environment", lambda v, w: _apply_allow_internet(*_environment(v, w, notes)))
    verifier = VerifierConfig(
        timeout_sec=s.pop("timeout_sec", _seconds, 600.0), env=s.pop("env", _str_map, {}),
        user=s.pop("user", _user), environment_mode=s.pop("environment_mode", _choice(VERIFIER_MODES)),
        environment=environment, collect=s.pop("collect", _list_of(lambda v, w: _collect(v, w, notes)), ()),
        network_mode=s.pop("network_mode", _choice(NETWORK_MODES)),
        allowed_hosts=s.pop("allowed_hosts", _allowed_hosts))
    s.done()
    _check_network(verifier.network_mode, verifier.allowed_hosts, where)
    if verifier.environment_mode == "shared" and verifier.environment is not None:
        raise FieldError(_join(where, "environment_mode"), "'shared' is incompatible with [verifier.environment]; "
                                                           "omit the environment or set environment_mode='separate'")
    return verifier


_BAD_STEP_CHARS = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_WINDOWS_DEVICE = re.compile(r"^(CON|PRN|AUX|NUL|CONIN\$|CONOUT\$|(?:COM|LPT)[1-9¹²³])$", re.IGNORECASE)


def _step_name(value: Any, where: str) -> str:
    name = _str(value, where)
    if (not name.strip() or name in (".", "..") or name.endswith((".", " ")) or _BAD_STEP_CHARS.search(name)
            or _WINDOWS_DEVICE.fullmatch(name.partition(".")[0].rstrip(" "))):
        raise FieldError(where, f"invalid step name {name!r}: it must be a portable directory name (no path "
                                f"separators, control or reserved characters, device names, trailing dots/spaces)")
    if len(name.encode("utf-8")) > 255:
        raise FieldError(where, "step names must be at most 255 UTF-8 bytes")
    return name


def _min_reward(value: Any, where: str) -> float | dict[str, float]:
    if isinstance(value, dict):
        return {k: _number(v, _join(where, k)) for k, v in value.items()}
    return _number(value, where)


def _step(value: Any, where: str, notes: ParseNotes) -> StepConfig:
    s = _Section(value, where, notes)
    if "name" not in s.data:
        raise FieldError(_join(where, "name"), "is required")
    step = StepConfig(name=s.pop("name", _step_name), agent=s.pop("agent", lambda v, w: _agent(v, w, notes),
                                                                  AgentConfig()),
                      verifier=s.pop("verifier", lambda v, w: _verifier(v, w, notes), VerifierConfig()),
                      min_reward=s.pop("min_reward", _min_reward),
                      healthcheck=s.pop("healthcheck", lambda v, w: _healthcheck(v, w, notes)),
                      artifacts=s.pop("artifacts", _list_of(lambda v, w: _artifact(v, w, notes)), ()))
    s.done()
    return step


def _package(value: Any, where: str, notes: ParseNotes) -> PackageInfo:
    s = _Section(value, where, notes)
    if "name" not in s.data:
        raise FieldError(_join(where, "name"), "is required")
    name = s.pop("name", _str)
    if not ORG_NAME.match(name) or ".." in name:
        raise FieldError(_join(where, "name"), f"must be 'org/name' (letters, digits, '.', '_', '-'; no leading "
                                               f"dot, no '..'), got {name!r}")
    version = s.pop("version", _opt_str)
    if version == "":
        raise FieldError(_join(where, "version"), "must not be empty")

    def author(v: Any, w: str) -> Author:
        a = _Section(v, w, notes)
        if "name" not in a.data:
            raise FieldError(_join(w, "name"), "is required")
        out = Author(a.pop("name", _str), a.pop("email", _opt_str))
        a.done()
        return out

    info = PackageInfo(name=name, version=version, description=s.pop("description", _str, ""),
                       authors=s.pop("authors", _list_of(author), ()), keywords=s.pop("keywords", _str_list, ()))
    s.done()
    return info


def parse_task_config(data: Mapping[str, Any], notes: ParseNotes | None = None) -> TaskConfig:
    """A `TaskConfig` from a parsed task.toml; `FieldError` names the field path of the first bad value."""
    notes = notes if notes is not None else ParseNotes()
    data = dict(data)
    if "version" in data:  # Harbor's `handle_version_rename`
        value = data.pop("version")
        data.setdefault("schema_version", value)
    s = _Section(data, "", notes)
    environment, explicit_mode = s.pop("environment", lambda v, w: _environment(v, w, notes),
                                       (EnvironmentConfig(), True))
    steps = s.pop("steps", _list_of(lambda v, w: _step(v, w, notes)))
    config = TaskConfig(
        schema_version=s.pop("schema_version", _str, "1.4"), task=s.pop("task", lambda v, w: _package(v, w, notes)),
        metadata=s.pop("metadata", lambda v, w: dict(_table(v, w)), {}),
        verifier=s.pop("verifier", lambda v, w: _verifier(v, w, notes), VerifierConfig()),
        agent=s.pop("agent", lambda v, w: _agent(v, w, notes), AgentConfig()),
        environment=_apply_allow_internet(environment, explicit_mode),
        solution=s.pop("solution", lambda v, w: _solution(v, w, notes), SolutionConfig()),
        source=s.pop("source", _opt_str),
        multi_step_reward_strategy=s.pop("multi_step_reward_strategy", _choice(REWARD_STRATEGIES)),
        steps=steps, artifacts=s.pop("artifacts", _list_of(lambda v, w: _artifact(v, w, notes)), ()))
    s.done()
    seen: dict[str, str] = {}
    for i, step in enumerate(config.steps or ()):
        key = unicodedata.normalize("NFC", step.name).casefold()
        if key in seen:
            raise FieldError(f"steps[{i}].name", f"step names must be unique (ignoring case and Unicode "
                                                 f"normalization): {step.name!r} repeats {seen[key]!r}")
        seen[key] = step.name
    return config


def _solution(value: Any, where: str, notes: ParseNotes) -> SolutionConfig:
    s = _Section(value, where, notes)
    out = SolutionConfig(env=s.pop("env", _str_map, {}))
    s.done()
    return out


# --- ${VAR} templates ------------------------------------------------------------------------------------
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


def resolve_env(env: Mapping[str, str], environ: Mapping[str, str], where: str) -> dict[str, str]:
    """Harbor's `resolve_env_vars`: a value that is exactly `${VAR}` or `${VAR:-default}` takes the host's VAR
    (else the default); other values are literal. An unset VAR without a default is a `FieldError`."""
    out = {}
    for key, value in env.items():
        match = _TEMPLATE.fullmatch(value)
        if not match:
            out[key] = value
        elif match.group(1) in environ:
            out[key] = environ[match.group(1)]
        elif match.group(2) is not None:
            out[key] = match.group(2)
        else:
            raise FieldError(_join(where, key), f"environment variable {match.group(1)!r} is not set on this host "
                                                f"(write ${{{match.group(1)}:-default}} for a default)")
    return out
