"""Exception types of slime_env. Each message names the input it is about."""


class SlimeEnvError(Exception):
    """Base class of every slime_env error."""


class InvalidInput(SlimeEnvError, ValueError):
    """A value given to slime_env (message, task, generation, config field) is malformed."""


class InfraError(SlimeEnvError):
    """A failure outside the model's reach — a container that did not start, a verifier whose machinery broke, a
    harness binary missing, the gateway or the engine gone. Raised from an env (reset, step, its verifier) or an agent
    program, it makes the episode's status `infra_error`: the trainer leaves it out of the loss and out of its group's
    statistics and counts it in the step's metrics; it is never scored 0 (docs/agentic.md, "Infrastructure failures").
    Raise it only where the model could not have caused the failure."""


def infra_cause(error: BaseException | None) -> InfraError | None:
    """The InfraError `error` is or was raised from (`raise X from infra_error`), else None."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, InfraError):
            return error
        error, seen = error.__cause__, seen + 1
    return None


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
