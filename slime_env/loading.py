"""Resolve extension points given as import paths (`pkg.mod:attr` or slime's `pkg.mod.attr`)."""

from __future__ import annotations

import importlib
from typing import Any

from slime_env.errors import InvalidInput


def load_object(path: str) -> Any:
    """Import and return the object named by `path` ("pkg.mod:attr", "pkg.mod.attr" or "path/to/file.py:attr")."""
    if not isinstance(path, str) or not path:
        raise InvalidInput(f"import path must be a non-empty string, got {path!r}")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise InvalidInput(f"import path {path!r} must look like 'package.module:name' or 'package.module.name'")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidInput(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidInput(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


def _import_file(filename: str) -> Any:
    """A Python file imported as a module (once per resolved path): user code outside any package."""
    import importlib.util
    import sys
    from pathlib import Path

    file = Path(filename).resolve()
    name = f"_slime_env_file_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    if not file.is_file():
        raise ImportError(f"no such file: {file}")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def lazy_exports(package: str, exports: dict[str, str]) -> Any:
    """A module `__getattr__` for `package` that imports `exports[name]` (a module path) on first access, so
    `import package` stays light while `from package import Name` works for every public name."""
    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
