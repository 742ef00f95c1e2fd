"""Claude Code (npm `@anthropic-ai/claude-code`, its native linux-x64 binary) on the gateway's Anthropic Messages.

Pointed at the session by `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY`; run headless (`-p`, JSON output), its turns
bounded by `--max-turns`, each reply by `CLAUDE_CODE_MAX_OUTPUT_TOKENS`. Its tool set is cut to `Bash` (`--tools`:
no sub-agent `Task` tool, no web tools, no tool search), no MCP server (`--strict-mcp-config`), and its system
prompt replaced by default (`--system-prompt`): its own prompt and tool set do not fit a small model's 8k context.
Telemetry, error reports, update checks and every other call but the model's are off by its own variables
(`CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC` and the specific ones); its config lives in the workspace's harness home.
"""

from __future__ import annotations

from slime_env.envs.harness.base import Harness, Launch, RunContext

QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
         "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
         "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "CLAUDE_CODE_DISABLE_CLAUDE_MDS": "1",
         "CLAUDE_CODE_DISABLE_GIT_INSTRUCTIONS": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
         "ENABLE_TOOL_SEARCH": "false", "MAX_THINKING_TOKENS": "0", "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
         "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}


def launch(ctx: RunContext) -> Launch:
    env = {**QUIET, "ANTHROPIC_BASE_URL": ctx.base_url, "ANTHROPIC_API_KEY": ctx.api_key,
           "CLAUDE_CONFIG_DIR": f"{ctx.home}/.claude", "ANTHROPIC_MODEL": ctx.model,
           "ANTHROPIC_SMALL_FAST_MODEL": ctx.model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ctx.bounds.max_output_tokens),
           # it refuses to skip permission prompts as root unless told it runs in a sandbox (it does: the workspace)
           "IS_SANDBOX": "1"}
    argv = ["-p", ctx.prompt, "--output-format", "json", "--max-turns", str(ctx.bounds.max_turns),
            "--model", ctx.model, "--tools", "Bash", "--strict-mcp-config", "--dangerously-skip-permissions"]
    if ctx.system_prompt is not None:
        argv += ["--system-prompt", ctx.system_prompt]
    return Launch(argv, env)


CLAUDE_CODE = Harness(
    name="claude-code", package="@anthropic-ai/claude-code", version="2.1.332",
    binary="node_modules/@anthropic-ai/claude-code-linux-x64/claude", api="anthropic", launch=launch,
    features={"tools": "yes (Bash; its file tools left out to fit 8k)", "streaming": "yes (every call)",
              "compaction": "not exercised (it assumes a 1M window for an unknown model)",
              "sub-agents": "off (--tools leaves out Task)"})
