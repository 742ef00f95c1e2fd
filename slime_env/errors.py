"""Exception types of slime_env. Each message names the input it is about."""


class SlimeEnvError(Exception):
    """Base class of every slime_env error."""


class InvalidInput(SlimeEnvError, ValueError):
    """A value given to slime_env (message, task, generation, config field) is malformed."""


class RegistryError(SlimeEnvError, KeyError):
    """An env id is unknown, registered twice, or its entry point cannot be loaded."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RenderError(SlimeEnvError):
    """A chat template could not render the messages it was given."""


class RenderMismatch(RenderError):
    """Strict mode: incremental tokens differ from a full render of the conversation.

    `index` is the first differing position in the full token sequence; `expected` / `actual`
    are the token ids there (None past the end of a sequence).
    """

    def __init__(self, message: str, index: int = -1, expected: int | None = None, actual: int | None = None):
        super().__init__(message)
        self.index, self.expected, self.actual = index, expected, actual
