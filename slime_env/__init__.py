"""slime_env: async Gymnasium-style environments and exact token-level trajectories for agentic RL.

Core API (this package never imports `envs`, `agents`, `tools_sandbox` or `trainers`):
- `Env`, `Wrapper`: the async env contract; `from_sync` adapts synchronous text envs.
- `register`, `make`, `spec`, `registry_ids`: the env registry (mirrored as `gymnasium.make("slime_env/<id>")`).
- `run_episode`: drives a `Policy` through an env and returns a `Trajectory` (token ledger).
- `MultiAgentEnv`, `run_multi_agent_episode`: several agents (turn-based or simultaneous), one ledger each.
- `get_renderer`: chat-template renderers that bridge the ledger between turns.
- `get_parser`: tool-call parsers (hermes, qwen3_coder, search_r1, python_block).
- `ScriptedPolicy`: a deterministic policy for tests and demos.
- `RolloutManager`, `load_tasks`: many episodes at once, in groups, persisted and resumable.
- `RemoteEnv`, `EnvServer`: an env served over HTTP (`slime-env serve-env`) and its client.
- `ToolEnv`, `StatefulToolEnv`, `tool`, `Rubric`: tool-use envs from typed Python functions (and MCP servers,
  `slime_env.integrations.mcp`).
- `Conversation`, `load_conversations`, `conversation_trajectory`: SFT data (chat conversations) as trajectories.
"""

from slime_env.agent_env import AgentEnv
from slime_env.conversations import Conversation, conversation_trajectory, load_conversations
from slime_env.env import Env, Wrapper
from slime_env.errors import InvalidInput, RegistryError, RenderError, RenderMismatch, SlimeEnvError
from slime_env.ledger import Span, TokenLedger
from slime_env.gateway import Gateway
from slime_env.multi_agent import MultiAgentEnv, run_multi_agent_episode
from slime_env.parsers import ParseResult, get_parser, parser_names, register_parser
from slime_env.policy import Policy, ScriptedPolicy
from slime_env.registry import EnvSpec, make, register, registry_ids, spec
from slime_env.renderers import TemplateRenderer, get_renderer, register_renderer
from slime_env.rollout import Batch, Group, RolloutManager, load_tasks
from slime_env.rollout.env_server import EnvServer, RemoteEnv, close_shared_clients
from slime_env.runner import Episode, run_episode
from slime_env.sync_env import SyncEnv, from_sync
from slime_env.tool_env import Rubric, StatefulToolEnv, ToolEnv, ToolRecord
from slime_env.tools import Tool, ToolArgumentError, ToolError, tool
from slime_env.trajectory import STATUSES, Trajectory
from slime_env.types import Action, Generation, Message, ParseError, Task, ToolCall

__version__ = "0.1.0"

from slime_env.registry import register_entry_points as _register_entry_points  # noqa: E402

_register_entry_points()

__all__ = [
    "Action", "AgentEnv", "Batch", "Conversation", "conversation_trajectory", "load_conversations", "Env", "EnvServer", "Episode", "Group", "RemoteEnv", "RolloutManager", "close_shared_clients",
    "load_tasks", "EnvSpec", "Gateway", "Generation", "InvalidInput", "Message", "MultiAgentEnv", "ParseError", "ParseResult", "Policy",
    "RegistryError", "RenderError", "RenderMismatch", "STATUSES", "ScriptedPolicy", "SlimeEnvError", "Span",
    "SyncEnv", "Task", "TemplateRenderer", "TokenLedger", "ToolCall", "Trajectory", "Wrapper", "from_sync",
    "get_parser", "get_renderer", "make", "parser_names", "register", "register_parser", "register_renderer",
    "registry_ids", "run_episode", "run_multi_agent_episode", "spec",
    "Rubric", "StatefulToolEnv", "Tool", "ToolArgumentError", "ToolEnv", "ToolError", "ToolRecord", "tool",
]
