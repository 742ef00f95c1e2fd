"""Known trajectories for the viewer and report tests, and a real headless Chromium to look at pages with.

The browser is Debian's `chromium` driven through `chromium-driver` (WebDriver) by selenium; nothing is
downloaded at run time (`.ci/run` installs both from the Debian archive). Without them the browser tests
skip with the reason; CI has them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from slime_env import Generation, ScriptedPolicy, Task, get_renderer, make, run_episode, run_multi_agent_episode
from slime_env.rollout.manager import Group

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class ExplodingPolicy(ScriptedPolicy):
    """Answers with a tool call, then the engine fails: a `failed` episode with a reason."""

    turns = 0

    def for_episode(self, session_id: str) -> ExplodingPolicy:
        return self

    async def generate(self, input_ids, params) -> Generation:
        self.turns += 1
        if self.turns > 1:
            raise RuntimeError("engine exploded on turn 2")
        return await super().generate(input_ids, params)


async def _trajectories(tok) -> dict[str, Any]:
    renderer = get_renderer(tok, strict=True)
    task = Task(prompt="What is 6 * 7?", label=42, id="calc-6x7")

    async def one(policy, max_turns=4):
        return await run_episode(make("Calculator-v0"), policy, task, renderer=renderer, max_turns=max_turns)

    solved = await one(ScriptedPolicy(tok, [CALL, "It is <answer>42</answer>"]))
    wrong = await one(ScriptedPolicy(tok, ["<answer>41</answer>"]))
    truncated = await one(ScriptedPolicy(tok, [CALL]), max_turns=2)
    failed = await one(ExplodingPolicy(tok, [CALL]))
    game = make("TicTacToe-v0")
    moves = {"x": ScriptedPolicy(tok, ["<move>5</move>", "<move>1</move>", "<move>9</move>"]),
             "o": ScriptedPolicy(tok, ["<move>2</move>", "<move>3</move>"])}
    agents = await run_multi_agent_episode(game, moves, {"prompt": "play"}, renderer=renderer)
    return {"solved": solved, "wrong": wrong, "truncated": truncated, "failed": failed, "agents": agents}


def write_store(tok, directory: Path) -> dict[str, Any]:
    """A rollout directory (`groups.jsonl`) with known trajectories: group 0 = the four calculator episodes
    (completed right, completed wrong, truncated, failed), group 1 = one tic-tac-toe game (two agents),
    group 2 = an episode with an off-policy span and a template-drift note."""
    t = asyncio.run(_trajectories(tok))
    directory.mkdir(parents=True, exist_ok=True)
    calc = [t["solved"], t["wrong"], t["truncated"], t["failed"]]
    game = list(t["agents"].values())
    drifted = json.loads(json.dumps(t["solved"].to_dict()))  # a copy: to_dict shares the lists
    first = drifted["spans"][0]
    drifted["spans"][0] = {**first, "kind": "offpolicy"}
    for j in range(first["start"], first["end"]):
        drifted["loss_mask"][j] = 0
    drifted["metadata"] = {**drifted["metadata"], "history_rewrites": ["qwen3 template re-renders history (test note)"]}
    records = [Group(0, calc[0].task, "Calculator-v0", calc).to_record(),
               Group(1, game[0].task, "TicTacToe-v0", game).to_record(),
               {"group_index": 2, "task_id": "calc-6x7", "env_id": "Calculator-v0", "accepted": True,
                "trajectories": [drifted]}]
    with (directory / "groups.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return t


def browser():
    """A headless Chromium WebDriver that logs network events; skips when the browser is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        why = "Debian's chromium and chromium-driver are not installed (.ci/host-deps installs them)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI must run the browser tests, never skip them
        pytest.skip(why)
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1000", "--disable-background-networking", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # Chromium's profile and singleton folders go where the suite puts third-party temporary files (tests/leftovers.py)
    env = {**os.environ, "TMPDIR": os.environ.get("SLIME_ENV_SUITE_TMP", tempfile.gettempdir())}
    return webdriver.Chrome(service=Service(executable_path=driver_path, env=env), options=options)


def network_requests(driver) -> list[str]:
    """URLs the page asked for (from Chrome's performance log), `file:` and `data:` excluded."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if not url.startswith(("file:", "data:", "about:")):
                urls.append(url)
    return urls


def open_page(driver, path: Path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
