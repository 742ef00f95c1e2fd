"""An agent loop written on the plain OpenAI SDK, working in a per-episode workspace: its model calls go to the
episode's gateway session (exact ledgers), its `bash` tool runs in the workspace, and the episode is scored by the
task's verifier after the agent stops — never by what the agent says.

    slime-env train --config examples/harbor_train.yaml --env examples/workspace_openai_agent.py:make_env
"""

from __future__ import annotations

import json

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in your Linux machine; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Call when the task is done.",
        "parameters": {"type": "object", "properties": {}}}},
]
SYSTEM = "You work in a Linux machine through the bash tool. Do the task, then call submit."


async def agent(base_url: str, api_key: str, task, workspace, max_steps: int = 12) -> str:
    """The whole agent: ask the model, run the bash calls it makes in the workspace, stop at submit."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    for _ in range(max_steps):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=256)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            if call.function.name == "submit":
                return "submitted"
            try:
                command = json.loads(call.function.arguments)["command"]
            except (ValueError, KeyError, TypeError):
                output = "error: bash needs {\"command\": \"...\"}"
            else:
                result = await workspace.exec(["bash", "-c", command], timeout_s=30)
                output = (result.stdout + result.stderr)[-4000:] or f"(no output, exit code {result.exit_code})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return "out of steps"


def make_env(verify=None, *, pool=None, image: str | None = None):
    """The agent as an env. `verify(task, workspace)` scores an episode (default: the task's Harbor verifier);
    `image`: the workspace when the task names none."""
    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.tools_sandbox.workspace import WorkspaceSpec

    if verify is None:
        from slime_env.envs.harbor import harbor_verify, harbor_workspace

        return WorkspaceAgentEnv(agent, harbor_verify, workspace=harbor_workspace, pool=pool, parser="hermes",
                                 deadline_s=600)
    spec = WorkspaceSpec(image=image, workdir="/app") if image else None
    return WorkspaceAgentEnv(agent, verify, spec=spec, pool=pool, parser="hermes", deadline_s=600)
