"""The file viewer/editor agents use (the SWE-agent / OpenHands `str_replace_editor` convention): `view` with line
numbers (or a folder two levels deep), `create`, `str_replace` (the old text must occur exactly once), `insert`
after a line, `undo_edit`. Pure text functions here; the env reads and writes the files through the workspace.
"""

from __future__ import annotations

from slime_env.tools import ToolError

SNIPPET_LINES = 4


def numbered(text: str, start: int = 1) -> str:
    """`cat -n` of `text` with line numbers from `start`."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start))


def view_file(path: str, text: str, view_range: list[int] | None) -> str:
    lines = text.split("\n")
    if view_range is None:
        return f"Here's the result of running `cat -n` on {path}:\n{numbered(text)}\n"
    if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
        raise ToolError("view_range must be two integers [start, end] (end -1: to the end of the file)")
    start, end = view_range
    n = len(lines) - (1 if lines and lines[-1] == "" else 0)
    if not 1 <= start <= max(n, 1):
        raise ToolError(f"view_range start {start} is outside the file's lines [1, {n}]")
    if end != -1 and not start <= end <= n:
        raise ToolError(f"view_range end {end} must be -1 or within [{start}, {n}]")
    chosen = "\n".join(lines[start - 1:] if end == -1 else lines[start - 1:end])
    return f"Here's the result of running `cat -n` on {path}:\n{numbered(chosen, start)}\n"


def str_replace(path: str, text: str, old: str, new: str) -> tuple[str, str]:
    """(new text, message); ToolError unless `old` occurs exactly once."""
    if old == "":
        raise ToolError("old_str must not be empty")
    count = text.count(old)
    if count == 0:
        raise ToolError(f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}.")
    if count > 1:
        lines = [i + 1 for i, line in enumerate(text.split("\n")) if old.split("\n")[0] in line]
        raise ToolError(f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines {lines}. "
                        "Please ensure it is unique.")
    result = text.replace(old, new, 1)
    line = text.split(old)[0].count("\n")
    return result, _edited(path, result, line, new.count("\n"))


def insert(path: str, text: str, after_line: int, new: str) -> tuple[str, str]:
    lines = text.split("\n")
    trailing = bool(lines) and lines[-1] == ""
    body = lines[:-1] if trailing else lines
    if not 0 <= after_line <= len(body):
        raise ToolError(f"insert_line {after_line} is outside the file's lines [0, {len(body)}]")
    added = new.split("\n")
    body = body[:after_line] + added + body[after_line:]
    result = "\n".join(body) + ("\n" if trailing else "")
    return result, _edited(path, result, after_line, len(added) - 1)


def _edited(path: str, text: str, first_line: int, added_lines: int) -> str:
    lines = text.split("\n")
    start = max(0, first_line - SNIPPET_LINES)
    end = first_line + added_lines + SNIPPET_LINES + 1
    snippet = "\n".join(lines[start:end])
    return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
            f"{numbered(snippet, start + 1)}\nReview the changes and make sure they are as expected. Edit the file "
            "again if necessary.")
