"""Problem statements written from the failing tests alone: their names and assertion messages, never the
mutation, its file or its line. `write_statement(...)` picks one of a few templates by the task's name, so the
same task always reads the same."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

MAX_TESTS_SHOWN = 5
MAX_MESSAGE_LINES = 12
MAX_MESSAGE_CHARS = 700

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_SOURCE_REF = re.compile(r"(?:/repo/)?(?:[\w.-]+/)*[\w.-]+\.py(?::\d+)?")
_TMP = re.compile(r"/tmp/\S+")


def clean_message(message: str, *, source_files: Iterable[str] = ()) -> str:
    """A failure message fit for a statement: object addresses, temporary paths and references to source files
    and lines removed, cut to a few lines."""
    text = _ADDRESS.sub("0x...", message)
    text = _TMP.sub("<tmp>", text)
    for f in sorted(source_files, key=len, reverse=True):
        text = re.sub(re.escape(f) + r"(?::\d+)?", "<source>", text)
    text = _SOURCE_REF.sub(lambda m: m.group() if "test" in m.group().rsplit("/", 1)[-1] else "<source>", text)
    text = re.sub(r'<source>"?,? line \d+', "<source>", text)
    lines = text.strip().splitlines()[:MAX_MESSAGE_LINES]
    text = "\n".join(lines)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " ..."


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def subject_of(node_id: str, names: set[str]) -> str | None:
    """The library name a test is about, guessed from its class and function names (`WindowedTests::test_basic`
    -> `windowed`, `test_merge_with` -> `merge_with`) and kept only if the package defines it."""
    parts = node_id.split("::")[1:]
    guesses: list[str] = []
    if len(parts) > 1:
        cls = re.sub(r"^Test|Tests?$|TestCase$", "", parts[-2])
        guesses += [cls, _snake(cls)]
    test = re.sub(r"^test_?", "", parts[-1].split("[")[0]) if parts else ""
    words = test.split("_")
    guesses += ["_".join(words[:n]) for n in range(len(words), 0, -1)]
    return next((g for g in guesses if g and g in names), None)


def write_statement(*, name: str, repo: str, source_dir: str, failures: list[tuple[str, str]],
                    names: set[str], source_files: Iterable[str] = (), suite_visible: bool = True) -> str:
    """The instruction of a task: `failures` are (node id, message) of its FAIL_TO_PASS tests, `names` the public
    names the package defines (to say which function the tests are about); `suite_visible`: whether any test
    file of the suite stays in the checkout (False when every file holds a failing test and is hidden, e.g. a
    one-file suite: the statement then says the whole suite is hidden)."""
    rng = random.Random(name)
    source_files = list(source_files)
    subjects = []
    for node, _ in failures:
        s = subject_of(node, names)
        if s and s not in subjects:
            subjects.append(s)
    shown = failures[:MAX_TESTS_SHOWN]
    blocks = []
    for node, message in shown:
        msg = clean_message(message, source_files=source_files) or "(no message)"
        blocks.append(f"- `{node}`\n\n  ```\n" + "\n".join(f"  {line}" for line in msg.splitlines()) + "\n  ```")
    more = len(failures) - len(shown)
    tests_md = "\n".join(blocks) + (f"\n\n... and {more} more failing test{'s' * (more > 1)}." if more > 0 else "")
    what = ", ".join(f"`{s}`" for s in subjects[:3])
    n = len(failures)
    template = rng.randrange(3)
    if template == 0:
        verb = "misbehaves" if len(subjects[:3]) == 1 else "misbehave"
        title = f"{what} {verb}" if what else f"{n} failing test{'s' * (n > 1)} in {repo}"
        intro = (f"Something in **{repo}** is broken{f' around {what}' if what else ''}: "
                 f"{'this test fails' if n == 1 else f'these {n} tests fail'} on the current code.")
    elif template == 1:
        title = f"Regression in {repo}" + (f": {what}" if what else "")
        fails = "a test that used to pass now fails" if n == 1 else f"{n} tests that used to pass now fail"
        intro = (f"After the latest change to {repo}, {fails}{f' (exercising {what})' if what else ''}. "
                 f"The failures:")
    else:
        title = f"Bug report: wrong behaviour{f' in {what}' if what else ''}"
        intro = (f"Running the {repo} test suite gives {n} failure{'s' * (n > 1)}"
                 f"{f'; all of them involve {what}' if what else ''}. Here is what the failing test"
                 f"{'s report' if n > 1 else ' reports'}:")
    # Say what is true of the checkout: the files of the failing tests are hidden whole (with any passing tests
    # they hold), and when those are all of the suite, nothing of it is there to run.
    tests = ("The test files of the failing tests are not in your checkout; the rest of the suite is, and it must "
             "keep passing." if suite_visible else
             "None of the test suite is in your checkout (every test file holds a failing test and is hidden); "
             "the whole suite must pass after your fix.")
    outro = (f"Find the cause in the package's code (`{source_dir}/`) and fix it there. {tests} Only edits to "
             f"existing `.py` files under `{source_dir}/` count: changes to tests, test configuration or new files "
             f"are not part of a fix.")
    return f"# {title}\n\n{intro}\n\n{tests_md}\n\n{outro}\n"
