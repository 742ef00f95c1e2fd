"""SearchCompute-v0: questions over the offline demo corpus that need search and then computation.

Two kinds of questions, both answerable only from retrieved passages plus a computation: how many
times a word occurs in the passage that begins with a quoted opening (find it, then count — e.g.
with python), and arithmetic on numbers hidden in quoted sentences of the reference (`list N lines
around the current line`: find the sentence, read N, compute). The model has three tools (a
`ToolEnv`): `search` (BM25 over the corpus), `python` (the sandbox) and `calculator`, and answers
in `<answer>...</answer>`. Reward: exact match of the number (1.0) plus `format_weight`
for a well-formed answer. Tasks come from `search_compute_tasks` (generated offline from the
corpus), so `gymnasium.make` works without arguments.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slime_env import Rubric, Task, ToolEnv
from slime_env.errors import InvalidInput
from slime_env.tool_env import answer_format, exact_answer

SYSTEM_PROMPT = (
    "Answer the question about the Python language reference. Tools: search(query) returns passages of the "
    "reference; calculator(expression) and python(code) compute. Call a tool with "
    '<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call> and read its result. '
    "When you know the answer, reply with <answer>NUMBER</answer> and no tool call.")

_SENTENCE = re.compile(r"(?:(?<=[.!?] )|^)[A-Z][^.!?|\[\]]{25,220}[.!?](?=\s|$)")
_NUMBER = re.compile(r"(?<![\w.\-+*/%])(\d{1,5})(?![\w.\-+*/%(])")
_WORD = re.compile(r"[a-z]{3,}")


@dataclass(frozen=True, slots=True)
class Fact:
    """A sentence of the corpus holding exactly one number (2..9999) that search can find again."""

    passage_id: str
    sentence: str
    number: int

    def masked(self, letter: str) -> str:
        return _NUMBER.sub(letter, self.sentence, count=1)


@functools.cache
def numeric_facts() -> tuple[Fact, ...]:
    """The demo corpus's sentences with one standalone number, each number's sentence once."""
    from slime_env.envs.search.corpus import demo_corpus

    facts, seen = [], set()
    for passage in demo_corpus():
        for sentence in _SENTENCE.findall(" ".join(passage.text.split())):
            numbers = _NUMBER.findall(sentence)
            if len(numbers) != 1 or int(numbers[0]) < 2 or sentence in seen or ">>>" in sentence or "=" in sentence:
                continue
            seen.add(sentence)
            facts.append(Fact(passage.id, sentence, int(numbers[0])))
    return tuple(facts)


_OPS = (("{a} + {b}", lambda a, b: a + b), ("{a} * {b}", lambda a, b: a * b), ("{a} - {b}", lambda a, b: a - b))


def count_word(word: str, text: str) -> int:
    """Whole-word, case-insensitive occurrences of `word` in `text` (how the count questions are meant)."""
    return len(re.findall(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE))


@functools.cache
def _openings() -> tuple[tuple[str, str, tuple[tuple[str, int], ...]], ...]:
    """Passages whose first 12 words are unique, with the words that occur 2..9 times in them."""
    from slime_env.envs.search.corpus import demo_corpus

    rows, counts = [], {}
    for passage in demo_corpus():
        words = passage.text.split()
        if len(words) < 60:
            continue
        opening = " ".join(words[:12])
        counts[opening] = counts.get(opening, 0) + 1
        if '"' in opening:
            continue  # quoted inside the question's quotes it would be ambiguous
        vocab = sorted(set(_WORD.findall(passage.text.lower())))
        good = tuple((w, n) for w in vocab if 2 <= (n := count_word(w, passage.text)) <= 9)
        if good:
            rows.append((passage.id, opening, good))
    return tuple(r for r in rows if counts[r[1]] == 1)


def search_compute_tasks(n: int = 200, seed: int = 0) -> list[Task]:
    """`n` questions: half word counts in a passage found by its opening, half arithmetic on hidden numbers
    (one hidden number times a constant plus another, or two hidden numbers combined)."""
    facts, openings = numeric_facts(), _openings()
    if len(facts) < 2 or not openings:
        raise RuntimeError("the demo corpus has too few numeric facts or passages for SearchCompute-v0")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.5:
            passage_id, opening, words = rng.choice(openings)
            word, count = rng.choice(words)
            prompt = (f'In the Python reference passage that begins "{opening} ...", how many times does the word '
                      f'"{word}" occur (whole words, any case)?')
            label, used, expression = count, [passage_id], f"count({word!r})"
            tasks.append(Task(prompt=prompt, label=str(label), id=f"search-compute-{seed}-{i}",
                              metadata={"passages": used, "expression": expression}))
            continue
        if kind < 0.7:
            fact = rng.choice(facts)
            k, c = rng.randint(2, 9), rng.randint(1, 99)
            prompt = (f'The Python reference says: "{fact.masked("N")}" What is N * {k} + {c}?')
            label, used, expression = fact.number * k + c, [fact.passage_id], f"{fact.number} * {k} + {c}"
        else:
            first, second = rng.sample(facts, 2)
            template, op = rng.choice(_OPS)
            prompt = (f'The Python reference says: "{first.masked("A")}" It also says: "{second.masked("B")}" '
                      f"What is {template.format(a='A', b='B')}?")
            label, used = op(first.number, second.number), [first.passage_id, second.passage_id]
            expression = template.format(a=first.number, b=second.number)
        tasks.append(Task(prompt=prompt, label=str(label), id=f"search-compute-{seed}-{i}",
                          metadata={"passages": used, "expression": expression}))
    return tasks


class SearchComputeEnv(ToolEnv):
    """Search + compute questions over the demo corpus with `search`, `python` and `calculator` tools.

    `retriever` (default: the shared offline demo index) and `sandbox` (default: `slime_env.tools_sandbox.auto()`,
    created on the first python call) are passed to the tools; `format_weight` is the reward for a
    well-formed `<answer>`; `max_turns` truncates.
    """

    describe_tools = False  # its system prompt shows the tool-call format itself

    def __init__(self, *, retriever: Any = None, sandbox: Any = None, topk: int = 3, max_turns: int = 8,
                 format_weight: float = 0.1, tool_timeout_s: float = 10.0, tasks: Any = None,
                 system_prompt: str = SYSTEM_PROMPT):
        from slime_env.envs.tools import calculator_tool, python_tool, search_tool

        tools = [search_tool(retriever, topk=topk, budget_tokens=1024), calculator_tool(),
                 python_tool(sandbox, timeout_s=tool_timeout_s)]
        super().__init__(tools, system_prompt=system_prompt,
                         rubric=Rubric(exact_answer, (answer_format, format_weight)),
                         max_turns=max_turns, tool_timeout_s=tool_timeout_s, tasks=tasks)

    def default_tasks(self) -> Sequence[Task]:
        return _default_tasks()

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        out = await super().reset(seed=seed, options=options)
        if self.task.label is None:  # exact_answer would score every answer 0 and only the format would pay
            raise InvalidInput("SearchCompute-v0 task has no 'label' (the gold answer)")
        return out


@functools.cache
def _default_tasks() -> tuple[Task, ...]:
    return tuple(search_compute_tasks())


__all__ = ["Fact", "SearchComputeEnv", "count_word", "numeric_facts", "search_compute_tasks"]
