"""OpenCode (npm `opencode-ai`, its native linux-x64 binary) on the gateway's Chat Completions.

Pointed at the session by a provider of its bundled `@ai-sdk/openai-compatible` in its config file (`OPENCODE_CONFIG`:
`baseURL`, `apiKey`, the model's context and output limits); run as `opencode run --pure` (no external plugins).
Its turns are bounded by the agent's `steps`, each reply by the model's `limit.output`; its tools are cut to `bash`
and its agent's prompt replaced to fit an 8k context. Update checks, sharing, the models.dev fetch, LSP downloads,
default plugins and Claude Code skill discovery are off by its own variables. Its first call (no tools) is its
session title, on the same model: a branch of its own in the ledger.
"""

from __future__ import annotations

import json

from slime_env.envs.harness.base import Harness, Launch, RunContext

OFF_TOOLS = ("edit", "write", "read", "glob", "grep", "list", "webfetch", "websearch", "codesearch", "todowrite",
             "todoread", "task", "patch", "skill", "question", "lsp")
QUIET = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
         "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
         "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
         "OPENCODE_DISABLE_TERMINAL_TITLE": "1"}


def launch(ctx: RunContext) -> Launch:
    limits = {"context": ctx.bounds.context_tokens, "output": ctx.bounds.max_output_tokens}
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": f"slime/{ctx.model}", "small_model": f"slime/{ctx.model}",
              "provider": {"slime": {"npm": "@ai-sdk/openai-compatible", "name": "slime-env gateway",
                                     "options": {"baseURL": ctx.base_url, "apiKey": ctx.api_key},
                                     "models": {ctx.model: {"name": ctx.model, "limit": limits}}}},
              "agent": {"build": {"steps": ctx.bounds.max_turns,
                                  **({"prompt": ctx.system_prompt} if ctx.system_prompt is not None else {})}},
              "tools": {name: False for name in OFF_TOOLS}, "lsp": False, "formatter": False, "snapshot": False,
              "mcp": {},
              # headless: a permission it would ask for is rejected; the workspace is the sandbox, so allow them
              "permission": {"bash": "allow", "external_directory": "allow"}}
    path = f"{ctx.home}/opencode.json"
    env = {**QUIET, "OPENCODE_CONFIG": path, "XDG_CONFIG_HOME": f"{ctx.home}/.config",
           "XDG_DATA_HOME": f"{ctx.home}/.local/share", "XDG_CACHE_HOME": f"{ctx.home}/.cache",
           "XDG_STATE_HOME": f"{ctx.home}/.local/state"}
    return Launch(["run", "--format", "json", "--pure", ctx.prompt], env, {path: json.dumps(config, indent=1)})


OPENCODE = Harness(
    name="opencode", package="opencode-ai", version="1.18.33",
    binary="node_modules/opencode-linux-x64/bin/opencode", api="openai", launch=launch,
    features={"tools": "yes (bash; its other tools off to fit 8k)", "streaming": "yes (every call)",
              "compaction": "not exercised", "sub-agents": "off (task tool off)"})
