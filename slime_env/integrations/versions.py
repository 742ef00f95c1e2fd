"""The versions of third-party packages an integration was built and tested against.

Ecosystem packages (OpenEnv, verifiers) change their APIs between minor releases. Each integration states the range it
supports and calls `require(...)` before importing the package, so a missing or skewed install fails at once with the
installed version, the supported range and the extra that installs it — never deep inside with an AttributeError.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from slime_env.errors import SlimeEnvError


class IntegrationVersionError(SlimeEnvError, ImportError):
    """A package an integration needs is missing, or installed at a version outside the supported range."""


def require(distribution: str, supported: str, *, extra: str, what: str) -> str:
    """The installed version of `distribution`, checked against the specifier `supported` ("">=0.10,<0.11"").

    `extra` names the slime_env extra that installs it; `what` the integration asking (for the message).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        installed = version(distribution)
    except PackageNotFoundError:
        raise IntegrationVersionError(
            f"{what} needs {distribution}{supported}, which is not installed: pip install 'slime_env[{extra}]'"
        ) from None
    try:
        ok = Version(installed) in SpecifierSet(supported)
    except InvalidVersion:
        ok = False
    if not ok:
        raise IntegrationVersionError(
            f"{what} supports {distribution}{supported}, but {distribution} {installed} is installed: "
            f"pip install 'slime_env[{extra}]' (or '{distribution}{supported}')")
    return installed


__all__ = ["IntegrationVersionError", "require"]
