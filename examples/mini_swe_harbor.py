"""mini-swe-agent, unchanged, trained on Harbor tasks: its model calls go through the gateway (exact token ledgers),
its commands run in each episode's workspace (the task's container), and the task's own verifier scores the episode
in a fresh workspace after the agent stops.

    slime-env train --config examples/harbor_agent_train.yaml --env examples/mini_swe_harbor.py:make_env
"""

from __future__ import annotations


def make_env(step_limit: int = 6, deadline_s: float = 900.0):
    from slime_env.envs.harbor import harbor_verify, harbor_workspace
    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.envs.workspace.mini_swe import mini_swe_agent

    # mini_textbased.yaml: commands in fenced blocks, no tool calling (any model; the 135M default one included)
    return WorkspaceAgentEnv(mini_swe_agent("mini_textbased.yaml", step_limit=step_limit), harbor_verify,
                             workspace=harbor_workspace, parser="hermes", deadline_s=deadline_s)
