"""A real MCP server for the tests, written with the SDK's server API: `python mcp_demo.py stdio` or
`python mcp_demo.py http PORT` (streamable HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("slime-env-test")
COUNTER = {"n": 0}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@server.tool()
def count() -> int:
    """How many times this tool was called in this server process."""
    COUNTER["n"] += 1
    return COUNTER["n"]


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def fail(message: str) -> str:
    """Fail with a message."""
    raise ValueError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "slept"


@server.tool()
def die() -> str:
    """Kill the server process mid-call."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
