"""Languages a sandbox can run: the file the code is written to and the command that runs it.

`{python}` and `{sh}` in a command are replaced by each backend with its own interpreter paths
(inside a container they differ from the host's). Add a language with `register_language`; a
backend runs it if its image or host has the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_env.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Language:
    """`filename` receives the code in the work dir; `command` runs it (placeholders: {python}, {sh}, {file})."""

    name: str
    filename: str
    command: tuple[str, ...]

    def argv(self, interpreters: dict[str, str]) -> list[str]:
        values = {**interpreters, "file": self.filename}
        return [part.format(**values) for part in self.command]


_LANGUAGES: dict[str, Language] = {}


def register_language(language: Language, *, override: bool = False) -> None:
    if language.name in _LANGUAGES and not override:
        raise InvalidInput(f"language {language.name!r} is already registered")
    _LANGUAGES[language.name] = language


def get_language(name: str) -> Language:
    try:
        return _LANGUAGES[name]
    except KeyError:
        raise InvalidInput(f"unknown language {name!r}; registered: {sorted(_LANGUAGES)}") from None


def language_names() -> list[str]:
    return sorted(_LANGUAGES)


# -s: no user site. The environment is each backend's own (never the caller's), and its PYTHONHASHSEED=0
# makes runs reproducible (set order, hash()). The work dir stays on sys.path so tests can import
# the solution's modules. -u: unbuffered, so output written before a kill is not lost.
register_language(Language("python", "main.py", ("{python}", "-s", "-u", "{file}")))
register_language(Language("shell", "main.sh", ("{sh}", "{file}")))
