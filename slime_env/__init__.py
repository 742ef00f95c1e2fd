"""slime_env: async Gymnasium-style environments and exact token-level trajectories for agentic RL.

Core API (this package never imports `envs`, `agents`, `tools_sandbox` or `trainers`):
- `Env`, `Wrapper`: the async env contract; `from_sync` adapts synchronous text envs.
- `register`, `make`, `spec`, `registry_ids`: the env registry (mirrored as `gymnasium.make("slime_env/<id>")`).
- `run_episode`: drives a `Policy` through an env and returns a `Trajectory` (token ledger).
- `MultiAgentEnv`, `run_multi_agent_episode`: several agents (turn-based or simultaneous), one ledger each.
- `EpisodeState`: one agent's ledger, conversation and status in a running episode (both loops' turn grows it).
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
from slime_env.episode_state import EpisodeState
from slime_env.errors import InfraError, InvalidInput, RegistryError, RenderError, RenderMismatch, SlimeEnvError
from slime_env.images import ImagePart, VisionInputs
from slime_env.ledger import Span, TokenLedger
from slime_env.gateway import Gateway
from slime_env.multi_agent import MultiAgentEnv, run_multi_agent_episode
from slime_env.parsers import ParseResult, get_parser, parser_names, register_parser
from slime_env.policy import Policy, ScriptedPolicy
from slime_env.registry import EnvSpec, make, register, registry_ids, spec
from slime_env.renderers import TemplateRenderer, VerifiedPrefix, get_renderer, register_renderer
from slime_env.rollout import Batch, Group, RolloutManager, load_tasks
from slime_env.rollout.env_server import EnvServer, RemoteEnv, close_shared_clients
from slime_env.runner import Episode, run_episode
from slime_env.sync_env import SyncEnv, from_sync
from slime_env.tool_env import Rubric, StatefulToolEnv, ToolEnv, ToolRecord
from slime_env.tools import Tool, ToolArgumentError, ToolError, ToolOutput, tool
from slime_env.trajectory import STATUSES, Trajectory
from slime_env.types import Action, Generation, Message, ParseError, Task, ToolCall

__version__ = "0.1.0"

from slime_env.registry import register_entry_points as _register_entry_points  # noqa: E402

_register_entry_points()

__all__ = [
    "Action", "AgentEnv", "Batch", "close_shared_clients", "Conversation", "conversation_trajectory", "Env",
    "EnvServer", "EnvSpec", "Episode", "EpisodeState", "from_sync", "Gateway", "Generation", "get_parser",
    "get_renderer", "Group", "ImagePart", "InfraError", "InvalidInput", "load_conversations", "load_tasks", "make",
    "Message", "MultiAgentEnv", "ParseError", "parser_names", "ParseResult", "Policy", "register", "register_parser",
    "register_renderer", "registry_ids", "RegistryError", "RemoteEnv", "RenderError", "RenderMismatch",
    "RolloutManager", "Rubric", "run_episode", "run_multi_agent_episode", "ScriptedPolicy", "SlimeEnvError", "Span",
    "spec", "StatefulToolEnv", "STATUSES", "SyncEnv", "Task", "TemplateRenderer", "TokenLedger", "tool", "Tool",
    "ToolArgumentError", "ToolCall", "ToolEnv", "ToolError", "ToolOutput", "ToolRecord", "Trajectory",
    "VerifiedPrefix", "VisionInputs", "Wrapper",
]
