"""mini-swe-agent (PyPI `mini-swe-agent`), unchanged, as a harness for `WorkspaceAgentEnv`.

Its `DefaultAgent` and its litellm model class run as shipped, from its own config files; only the two extension
points it documents are filled: the model's `api_base` / `api_key` point at this episode's gateway session, and the
environment (a class with `execute` / `get_template_vars` / `serialize`, as its docs describe) runs every command in
the episode's workspace. Its submit rule is its own: a command whose output starts with
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` ends the run. The agent loop is synchronous: it runs in a thread and its
commands hop onto the event loop that owns the workspace.
"""

from __future__ import annotations

import asyncio
import os
import platform
from collections.abc import Callable
from typing import Any

from slime_env.errors import InfraError
from slime_env.tools_sandbox.workspace import Workspace, WorkspaceError

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# mini-swe-agent reads these at import: no start-up banner, no config folder in $HOME, no price-list download, no
# cost tracking for a model litellm does not know (our gateway's), few retries of a failed call.
_QUIET = {"MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
          "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2", "MSWEA_CONFIGURED": "true"}


def _import_mini():
    for key, value in _QUIET.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(os.path.expanduser("~"), ".cache", "slime_env",
                                                                  "mini-swe-agent"))
    try:
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.config import get_config_from_spec
        from minisweagent.exceptions import Submitted
        from minisweagent.models import get_model
    except ImportError as e:
        # the host's setup, not the model's doing: the episode is infra_error, never a 0
        raise InfraError(f"mini-swe-agent is not installed (pip install 'mini-swe-agent>=2.4.6,<2.5'): {e}") from None
    import litellm

    litellm.suppress_debug_info = True  # its "Provider List" banner on every call to a model it does not price
    return DefaultAgent, get_config_from_spec, Submitted, get_model


class WorkspaceEnvironment:
    """mini-swe-agent's environment interface over a `Workspace` (its commands run there, by `bash -c`)."""

    def __init__(self, workspace: Workspace, loop: asyncio.AbstractEventLoop, *, cwd: str = "", timeout: int = 60,
                 env: dict[str, str] | None = None, **_: Any):
        self.workspace, self.loop = workspace, loop
        self.config = {"cwd": cwd or workspace.workdir, "timeout": timeout, "env": dict(env or {})}
        _, _, self._submitted, _ = _import_mini()

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        limit = timeout or self.config["timeout"]
        coro = self.workspace.exec(["bash", "-c", action["command"]], cwd=cwd or self.config["cwd"],
                                   env=self.config["env"], timeout_s=limit)
        try:
            result = asyncio.run_coroutine_threadsafe(coro, self.loop).result(limit + 60)
        except WorkspaceError as e:
            return {"output": "", "returncode": -1, "exception_info": f"the workspace failed: {e}"}
        output = result.stdout + result.stderr  # the agent reads one stream (its local env merges them)
        info = "" if result.status in ("ok", "error") else f"{result.status}: {result.reason}"
        out = {"output": output, "returncode": result.exit_code if result.exit_code is not None else -1,
               "exception_info": info}
        lines = output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and out["returncode"] == 0:
            submission = "".join(lines[1:])
            raise self._submitted({"role": "exit", "content": submission,
                                   "extra": {"exit_status": "Submitted", "submission": submission}})
        return out

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return platform.uname()._asdict() | {"cwd": self.config["cwd"]} | kwargs

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": self.config, "environment_type": "slime_env.workspace"}}}


def mini_swe_agent(config: str = "mini_textbased.yaml", *, model_class: str | None = "litellm_textbased",
                   step_limit: int = 20, command_timeout_s: int = 60, overrides: dict[str, Any] | None = None
                   ) -> Callable[..., Any]:
    """An agent for `WorkspaceAgentEnv`: mini-swe-agent's `DefaultAgent` with its shipped `config` (its
    `mini_textbased.yaml`: commands in fenced blocks, for models without tool calling; `mini.yaml` with
    `model_class=None`: its tool-calling model). Returns `{"exit_status", "submission", "n_calls"}`."""

    async def agent(base_url: str, api_key: str, task, workspace: Workspace) -> dict[str, Any]:
        DefaultAgent, get_config_from_spec, _, get_model = _import_mini()
        cfg = get_config_from_spec(config)
        model_cfg = dict(cfg["model"])
        model_cfg.update(model_name="openai/policy", cost_tracking="ignore_errors",
                         model_kwargs={**model_cfg.get("model_kwargs", {}), "api_base": base_url, "api_key": api_key})
        if model_class:
            model_cfg["model_class"] = model_class
        env_cfg = cfg.get("environment", {})
        env_vars = {k: v for k, v in (env_cfg.get("env") or {}).items() if k != "BASH_ENV"}
        environment = WorkspaceEnvironment(workspace, asyncio.get_running_loop(), timeout=command_timeout_s,
                                           env=env_vars)
        agent_cfg = {**cfg.get("agent", {}), "step_limit": step_limit, "cost_limit": 0, **(overrides or {})}

        def run() -> dict[str, Any]:
            runner = DefaultAgent(get_model(config=model_cfg), environment, **agent_cfg)
            info = runner.run(task.prompt)
            return {"exit_status": info.get("exit_status"), "submission": info.get("submission"),
                    "n_calls": runner.n_calls}

        return await asyncio.to_thread(run)

    return agent
