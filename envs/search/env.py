"""Search-v0: Search-R1's multi-turn search task (arXiv 2503.09516).

The model reasons in `<think>`, queries `<search>q</search>`, reads `<information>…</information>`,
and answers `<answer>…</answer>`; the reward is exact match after SQuAD normalisation against any gold
answer (substring EM, token F1 and a format score are options). The action is the first
`<search>`/`<answer>` of the turn (Search-R1's regex); generation stops at `</search>` / `</answer>`.
Retrieved passages (top `topk`, `Doc i(Title: …) …`) are spliced into the assistant's own text as
`\\n\\n<information>…</information>\\n\\n`, as Search-R1 does, so the model continues the same turn; they
are cut to `observation_budget_tokens` (the passages are cut, never the wrapper). A turn with neither
tag gets Search-R1's invalid-action hint. After `max_turns` actions without an answer the env truncates.

Tasks: a question string (Search-R1's prompt template is applied) or chat messages used verbatim
(Search-R1's training parquet already holds the templated prompt); the label is the list of gold
answers. Only the model's own turns are scored, so the example answer inside the prompt template
(`<answer> Beijing </answer>`) can never count.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_env import Action, Env, Message, Task
from slime_env.errors import InvalidInput
from slime_env.envs.search.corpus import Passage, format_passages
from slime_env.envs.search.retrievers import Retriever, load_retriever
from slime_env.envs.search.rewards import SearchReward

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Question: {question}\n")
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
                  "</search>. If I want to give the final answer, I should put the answer between <answer> and "
                  "</answer>. Let me try again.\n")

_SHARED: dict[str, Retriever] = {}


def shared_retriever(spec: str | Path | None = None) -> Retriever:
    """One retriever per index folder / URL in this process. Default: `SLIME_ENV_RETRIEVER`, else the demo
    BM25 index (built once into ~/.cache/slime_env/search/demo-bm25 from the demo corpus)."""
    spec = str(spec or os.environ.get("SLIME_ENV_RETRIEVER") or demo_index())
    if spec not in _SHARED:
        _SHARED[spec] = load_retriever(spec)
    return _SHARED[spec]


def demo_index() -> Path:
    from slime_env.envs.search.corpus import demo_corpus
    from slime_env.envs.search.retrievers import BM25Retriever

    path = Path(os.environ.get("SLIME_ENV_CACHE", Path.home() / ".cache" / "slime_env")) / "search" / "demo-bm25"
    if not (path / "manifest.json").exists():
        BM25Retriever.build(demo_corpus(), path)
    return path


@functools.cache
def _demo_tasks() -> tuple[Task, ...]:
    """The demo corpus's questions as tasks (built once per process: finding them parses the whole corpus)."""
    from slime_env.envs.search.corpus import demo_questions

    return tuple(Task(prompt=q["question"], label=q["answers"], id=f"demo-{i}")
                 for i, q in enumerate(demo_questions()))


class SearchEnv(Env):
    """Search-R1 search environment (see the module docstring)."""

    parser = "search_r1"
    stop = ("</search>", "</answer>")

    def __init__(self, *, retriever: Retriever | str | None = None, topk: int = 3, max_turns: int = 4,
                 observation_budget_tokens: int = 500, count_tokens: Callable[[str], int] | None = None,
                 template: str = SEARCH_R1_TEMPLATE, reward: str | Callable = "em", format_score: float = 0.0,
                 tasks: Any = None):
        if topk < 1 or max_turns < 1:
            raise InvalidInput(f"topk and max_turns must be >= 1, got {topk} and {max_turns}")
        if "{question}" not in template:
            raise InvalidInput("template must contain {question}")
        self.set_tasks(tasks)  # resets without a task draw from these, else from the demo corpus's questions
        self._retriever = retriever
        self.topk, self.max_turns = topk, max_turns
        self.budget, self.count_tokens = observation_budget_tokens, count_tokens
        self.template = template
        self.reward = SearchReward(reward, format_score)
        self._task: Task | None = None
        self._golds: list[str] = []
        self._turns = 0
        self.searches: list[str] = []

    def default_tasks(self) -> Sequence[Task]:
        return _demo_tasks()

    @property
    def retriever(self) -> Retriever:
        if not isinstance(self._retriever, Retriever):
            self._retriever = shared_retriever(self._retriever)
        return self._retriever

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._task = self.task_from(options, seed)
        golds = self._task.label
        if isinstance(golds, Mapping):  # Search-R1 parquet: reward_model.ground_truth.target
            golds = golds.get("target", golds.get("ground_truth", {}).get("target") if isinstance(
                golds.get("ground_truth"), Mapping) else None)
        if golds is None or (isinstance(golds, (list, tuple)) and not golds):
            raise InvalidInput("Search-v0 task has no gold answers in 'label'")
        self._golds = [str(golds)] if isinstance(golds, (str, int, float)) else [str(g) for g in golds]
        self._turns = 0
        self.searches = []
        if isinstance(self._task.prompt, str):
            return [Message("user", self.template.format(question=self._task.prompt.strip()))], {}
        return self._task.messages(), {}

    async def step(self, action: Action):
        if self._task is None:
            raise RuntimeError("SearchEnv.step called before reset")
        self._turns += 1
        call = action.tool_calls[0] if action.tool_calls else None
        if call is not None and call.name == "answer":
            answer = call.arguments["answer"]
            score = self.reward(answer, self._golds)
            return [], score, True, False, self._info(answer=answer, golds=self._golds, correct=score >= 1.0)
        if call is not None and call.name == "search":
            self.searches.append(call.arguments["query"])
        if self._turns >= self.max_turns:  # out of turns: nothing follows, so nothing is retrieved
            return [], 0.0, False, True, self._info()
        if call is not None and call.name == "search":
            hits = (await self.retriever.search([call.arguments["query"]], self.topk))[0]
            text = self._information([p for p, _ in hits])
        else:
            text = INVALID_ACTION
        return [Message("assistant", text)], 0.0, False, False, self._info()

    def _info(self, **extra: Any) -> dict[str, Any]:
        # tool_stats in ToolEnv's shape, so evaluation counts searches as tool calls (`solved_with_tool`)
        return {**extra, "searches": list(self.searches), "tool_stats": {"search": {"calls": len(self.searches)}}}

    def _information(self, passages: Sequence[Passage]) -> str:
        body = format_passages(passages).strip()
        return f"\n\n<information>{self._cut(body)}</information>\n\n"

    def _cut(self, text: str) -> str:
        if self.count_tokens is None:
            limit = self.budget * 4
            return text if len(text) <= limit else text[:limit].rstrip() + " ..."
        if self.count_tokens(text) <= self.budget:
            return text
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.count_tokens(text[:mid] + " ...") <= self.budget else (lo, mid - 1)
        return text[:lo].rstrip() + " ..."
