"""Codex CLI (npm `@openai/codex`, its native linux-x64 binary) on the gateway's Responses API.

Pointed at the session by a custom model provider in `$CODEX_HOME/config.toml` (`base_url`, the key in
`env_key`, `wire_api = "responses"`, no retries); run as `codex exec` with approvals off and its own sandbox off (the
workspace is the sandbox). Its hosted and multi-agent tools are switched off by its own feature switches
(`multi_agent`, `goals`, `image_generation`, `web_search`): left on, the gateway refuses their tool types. Update
checks, analytics, feedback, OpenTelemetry and history files are off in the same config. Codex has no turn limit in
`exec`: its run is bounded by `timeout_s` and by the context window it is told (`model_context_window`). Its base
instructions (~3,800 tokens) are replaced by default (`model_instructions_file`): its first prompt goes from ~5,600
tokens to ~1,800 (its four tools written into the system message stay).
"""

from __future__ import annotations

import json

from slime_env.envs.harness.base import Harness, Launch, RunContext

SWITCHED_OFF = ("multi_agent", "goals", "image_generation")


def launch(ctx: RunContext) -> Launch:
    q = json.dumps  # TOML basic strings take JSON's escapes
    config = f"""model = {q(ctx.model)}
model_provider = "slime"
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "danger-full-access"
model_context_window = {ctx.bounds.context_tokens}
web_search = "disabled"
{f"model_instructions_file = {q(ctx.home + '/.codex/instructions.md')}" if ctx.system_prompt else ""}
[model_providers.slime]
name = "slime-env gateway"
base_url = {q(ctx.base_url)}
env_key = "SLIME_GATEWAY_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {int(ctx.bounds.timeout_s * 1000)}
[history]
persistence = "none"
[analytics]
enabled = false
[feedback]
enabled = false
[otel]
exporter = "none"
log_user_prompt = false
"""
    argv = ["exec", "--skip-git-repo-check", "--cd", ctx.workdir, "--json"]
    for feature in SWITCHED_OFF:
        argv += ["--disable", feature]
    env = {"CODEX_HOME": f"{ctx.home}/.codex", "SLIME_GATEWAY_KEY": ctx.api_key}
    files = {f"{ctx.home}/.codex/config.toml": config}
    if ctx.system_prompt:  # replaces its base instructions (~3,800 tokens)
        files[f"{ctx.home}/.codex/instructions.md"] = ctx.system_prompt
    return Launch([*argv, ctx.prompt], env, files)


CODEX = Harness(
    name="codex", package="@openai/codex", version="0.171.0",
    binary="node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex", api="openai",
    launch=launch,
    features={"tools": "yes (exec_command, write_stdin, request_user_input, view_image as functions)",
              "streaming": "yes (every call)", "compaction": "not exercised (server-side context_management refused)",
              "sub-agents": "off (multi_agent disabled; its namespace tool is refused)"})
