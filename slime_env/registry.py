"""Env registry: `register` / `make` / `spec` / `registry_ids`, mirrored into Gymnasium.

Built-in and third-party envs are found through the `slime_env.envs` entry-point group: each entry
point names a function that calls `register(...)`. They are loaded lazily, the first time an
unknown id is looked up or the ids are listed, so `import slime_env` never imports `envs`.
Every id is also registered with Gymnasium as `slime_env/<id>` (a synchronous text env).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput, RegistryError
from slime_env.loading import load_object

ENTRY_POINT_GROUP = "slime_env.envs"
GYM_NAMESPACE = "slime_env"
_ID = re.compile(r"^[A-Za-z][\w.:-]*$")


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """A registered env: its id, how to build it, default kwargs and a one-line description."""

    id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def make(self, **kwargs: Any) -> Env:
        factory = load_object(self.entry_point) if isinstance(self.entry_point, str) else self.entry_point
        try:
            env = factory(**{**self.kwargs, **kwargs})
        except TypeError as e:
            raise InvalidInput(f"cannot make {self.id!r} with kwargs {sorted({**self.kwargs, **kwargs})}: {e}") from e
        if not isinstance(env, Env):
            raise RegistryError(f"entry point of {self.id!r} returned {type(env).__name__}, not a slime_env.Env")
        return env


_REGISTRY: dict[str, EnvSpec] = {}
_plugins_loaded = False


def register(id: str, entry_point: str | Callable[..., Env], *, description: str = "", override: bool = False,
             **defaults: Any) -> EnvSpec:
    """Register env `id` ("Name-v0"); `entry_point` is "pkg.mod:Class" or a callable returning an Env."""
    if not isinstance(id, str) or not _ID.match(id):
        raise InvalidInput(f"env id {id!r} must start with a letter and use letters, digits, '_', '-', '.', ':'")
    if id in _REGISTRY and not override:
        if _REGISTRY[id].entry_point == entry_point:
            return _REGISTRY[id]  # re-registering the same thing (module imported twice) is harmless
        raise RegistryError(f"env id {id!r} is already registered (entry point {_REGISTRY[id].entry_point!r})")
    spec_ = EnvSpec(id=id, entry_point=entry_point, kwargs=dict(defaults), description=description)
    _REGISTRY[id] = spec_
    _register_with_gymnasium(id)
    return spec_


def spec(id: str) -> EnvSpec:
    """The spec of a registered id (loading plugins if needed); RegistryError naming close matches if none."""
    if id not in _REGISTRY:
        load_plugins()
    try:
        return _REGISTRY[id]
    except KeyError:
        close = [k for k in _REGISTRY if k.split("-v")[0].lower() == id.split("-v")[0].lower()]
        hint = f"; did you mean {close}?" if close else f"; registered: {sorted(_REGISTRY)}"
        raise RegistryError(f"no env registered as {id!r}{hint}") from None


def make(id: str, **kwargs: Any) -> Env:
    """Build the async env registered as `id`; kwargs override the registered defaults."""
    return spec(id).make(**kwargs)


def registry_ids() -> list[str]:
    """All registered env ids, sorted (built-in and plugin envs included)."""
    load_plugins()
    return sorted(_REGISTRY)


def registry_specs() -> list[EnvSpec]:
    load_plugins()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def load_plugins() -> None:
    """Call every `slime_env.envs` entry point once (each registers its envs)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not hide the others
            raise RegistryError(f"env plugin {ep.name!r} ({ep.value}) failed to load: {e}") from e


def _register_with_gymnasium(id: str) -> None:
    import gymnasium

    gym_id = f"{GYM_NAMESPACE}/{id}"
    if gym_id in gymnasium.registry:
        del gymnasium.registry[gym_id]
    gymnasium.register(id=gym_id, entry_point="slime_env.gym_adapter:make_gym_env", kwargs={"env_id": id},
                       disable_env_checker=True)
