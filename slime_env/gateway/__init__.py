"""Bring your own agent: an OpenAI-compatible gateway that records any agent program's calls as exact token
ledgers (`Gateway`), and how its calls map to trajectories (`Conversation`: continuation and branches)."""

from slime_env.gateway.conversation import Branch, Conversation, GatewayError
from slime_env.gateway.server import AgentSession, Gateway

__all__ = ["AgentSession", "Branch", "Conversation", "Gateway", "GatewayError"]
