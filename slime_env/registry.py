"""Env registry: `register` / `make` / `spec` / `registry_ids`, mirrored into Gymnasium.

Built-in and third-party envs are declared in the `slime_env.envs` entry-point group, one entry
point per env: its name is the env id and its value the `module:Class` to build. They are
registered when `slime_env` is imported, from package metadata alone: the module is imported only
when the env is made, so `import slime_env` never imports `envs`. Every id is also registered with
Gymnasium as `slime_env/<id>` (a synchronous text env).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput, RegistryError
from slime_env.loading import load_object
from slime_env.multi_agent import MultiAgentEnv

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
        from slime_env.agent_env import AgentEnv

        if not isinstance(env, (Env, MultiAgentEnv, AgentEnv)):
            raise RegistryError(f"entry point of {self.id!r} returned {type(env).__name__}, not a slime_env.Env, "
                                f"MultiAgentEnv or AgentEnv")
        return env

    @property
    def multi_agent(self) -> bool:
        """Whether the env is a `MultiAgentEnv` (loads its class): run it with `run_multi_agent_episode`.
        False when the entry point cannot be loaded (`make` names that problem)."""
        try:
            target = load_object(self.entry_point) if isinstance(self.entry_point, str) else self.entry_point
        except InvalidInput:
            return False
        return isinstance(target, type) and issubclass(target, MultiAgentEnv)


_REGISTRY: dict[str, EnvSpec] = {}


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
    """The spec of a registered id (or of an import path "pkg.mod:factory" / "file.py:factory", unregistered);
    RegistryError naming close matches if none."""
    try:
        return _REGISTRY[id]
    except KeyError:
        if isinstance(id, str) and ":" in id:  # "pkg.mod:make_env" or "my_env.py:MyEnv": built without registering
            return EnvSpec(id=id, entry_point=id)
        close = [k for k in _REGISTRY if k.split("-v")[0].lower() == id.split("-v")[0].lower()]
        hint = f"; did you mean {close}?" if close else f"; registered: {sorted(_REGISTRY)}"
        raise RegistryError(f"no env registered as {id!r}{hint}") from None


def make(id: str, **kwargs: Any) -> Env | MultiAgentEnv:
    """Build the async env registered as `id`; kwargs override the registered defaults."""
    return spec(id).make(**kwargs)


def registry_ids() -> list[str]:
    """All registered env ids, sorted (built-in and plugin envs included)."""
    return sorted(_REGISTRY)


def registry_specs() -> list[EnvSpec]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def adopt_specs(specs: Mapping[str, EnvSpec]) -> None:
    """Register specs another process registered at run time (a rollout worker's parent); ids known here stay."""
    for env_id, env_spec in specs.items():
        _REGISTRY.setdefault(env_id, env_spec)


def describe(spec_: EnvSpec) -> str:
    """One line, a whole sentence: the spec's description, else the env module's headline when it names the env
    ("<id>: what it is", "`Class`: ...", "`Class` (`<id>`): ..."), else the first sentence of the env class's
    docstring (without pointers such as "(see the module docstring)")."""
    if spec_.description:
        return spec_.description
    try:
        target = load_object(spec_.entry_point) if isinstance(spec_.entry_point, str) else spec_.entry_point
    except InvalidInput as e:
        return f"(cannot load: {e})"
    module = sys.modules.get(getattr(target, "__module__", ""), None)
    headline = _first_paragraph(getattr(module, "__doc__", None))
    name = getattr(target, "__name__", "")
    for prefix in (f"{spec_.id}:", f"`{name}`:", f"`{name}` (`{spec_.id}`):"):
        if name and headline.startswith(prefix):
            return _first_sentence(headline[len(prefix):])
    text = _first_sentence(_first_paragraph(target.__doc__))
    return re.sub(r"\s*\((see )?(the )?module docstring\)", "", text)


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text.strip())
    return m.group(1) if m else text.strip()


def register_entry_points() -> None:
    """Register every env declared in the `slime_env.envs` entry-point group (without importing it)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register(ep.name, ep.value)


def _register_with_gymnasium(id: str) -> None:
    import gymnasium

    gym_id = f"{GYM_NAMESPACE}/{id}"
    if gym_id in gymnasium.registry:
        del gymnasium.registry[gym_id]
    gymnasium.register(id=gym_id, entry_point="slime_env.gym_adapter:make_gym_env", kwargs={"env_id": id},
                       disable_env_checker=True)
