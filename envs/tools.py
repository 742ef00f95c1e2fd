"""Ready-made tools for `ToolEnv`s: sandboxed Python, the search retriever, the calculator.

Each function returns a `slime_env.Tool` (schema from a typed, documented function) that any tool env
can list: `ToolEnv([python_tool(), search_tool(), calculator_tool()])`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slime_env.envs.budget import truncate_to_budget

from slime_env import Tool, ToolError, tool


def calculator_tool(name: str = "calculator") -> Tool:
    """Safe arithmetic (`slime_env.envs.calculator.evaluate`); a refused expression is an error observation."""
    from slime_env.envs.arithmetic import CalculatorError, evaluate

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+ - * / // % ** and parentheses).

        Args:
            expression: the expression, e.g. "12 * (3 + 4)"
        """
        try:
            return str(evaluate(expression))
        except CalculatorError as e:
            raise ToolError(str(e)) from None

    return tool(calculator, name=name)


def python_tool(sandbox: Any = None, *, timeout_s: float = 5.0, memory_mb: int = 512, output_budget_tokens: int = 256,
                count_tokens: Callable[[str], int] | None = None, on_run: Callable[[Any], None] | None = None,
                name: str = "python") -> Tool:
    """Run Python in a `tools_sandbox` sandbox (a sandbox, a function returning one, or None:
    `slime_env.tools_sandbox.auto()`).

    The model reads stdout and stderr cut to `output_budget_tokens`, with `[timed out after ...]` or the
    sandbox's status appended: a failing run is an observation, not an error. `on_run(result)` sees every
    `RunResult`. The sandbox enforces `timeout_s`; the tool's own timeout is a backstop above it.
    """

    def get_sandbox():
        if callable(sandbox) and not hasattr(sandbox, "run"):
            return sandbox()
        if sandbox is not None:
            return sandbox
        from slime_env import tools_sandbox

        return tools_sandbox.auto()

    async def python(code: str) -> str:
        """Run Python 3 code and return what it prints (stdout and stderr).

        Args:
            code: the program to run
        """
        result = await get_sandbox().run(code, timeout_s=timeout_s, memory_mb=memory_mb)
        if on_run is not None:
            on_run(result)
        return format_run(result, timeout_s, output_budget_tokens, count_tokens)

    return tool(python, name=name, timeout_s=2 * timeout_s + 30)


def format_run(result: Any, timeout_s: float, budget_tokens: int, count_tokens: Callable[[str], int] | None) -> str:
    """A sandbox `RunResult` as the model reads it: output, then how the run ended if not normally."""
    text = result.stdout + (("\n" if result.stdout and result.stderr else "") + result.stderr)
    if result.status == "timeout":
        text += f"\n[timed out after {timeout_s:g}s]"
    elif result.status in ("memory", "output_limit", "sandbox_error"):
        text += f"\n[{result.status}: {result.reason}]"
    return truncate_to_budget(text.strip() or "(no output)", budget_tokens, count_tokens)


def search_tool(retriever: Any = None, *, topk: int = 3, budget_tokens: int = 512,
                count_tokens: Callable[[str], int] | None = None, name: str = "search") -> Tool:
    """Search a corpus with an `slime_env.envs.search` retriever (an object, an index folder / URL, or None: the
    shared default, the offline demo index); returns the top passages as `Doc i(Title: ...) text` lines."""
    from slime_env.envs.search.corpus import format_passages
    from slime_env.envs.search.env import shared_retriever

    chosen: list[Any] = []

    async def search(query: str) -> str:
        """Search the reference corpus and return the best matching passages.

        Args:
            query: what to look for, in a few words or a sentence
        """
        if not query.strip():
            raise ToolError("the query is empty")
        if not chosen:
            chosen.append(retriever if hasattr(retriever, "search") else shared_retriever(retriever))
        hits = (await chosen[0].search([query], topk))[0]
        if not hits:
            return "(no passages found)"
        return truncate_to_budget(format_passages([p for p, _ in hits]).strip(), budget_tokens, count_tokens)

    return tool(search, name=name)


__all__ = ["calculator_tool", "format_run", "python_tool", "search_tool"]
