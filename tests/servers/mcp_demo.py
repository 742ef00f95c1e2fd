"""A real MCP server for the tests, written with the SDK's server API: `python mcp_demo.py stdio` or
`python mcp_demo.py http PORT` (streamable HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer

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


ACTIVE = {"now": 0, "peak": 0}


@server.tool()
async def busy(seconds: float) -> int:
    """Hold a call for `seconds`; answers the most calls this server has seen in flight at once."""
    ACTIVE["now"] += 1
    ACTIVE["peak"] = max(ACTIVE["peak"], ACTIVE["now"])
    try:
        await asyncio.sleep(seconds)
    finally:
        ACTIVE["now"] -= 1
    return ACTIVE["peak"]


@server.tool()
async def long_job(steps: int, ctx: Context) -> str:
    """A long-running job that reports its progress."""
    for i in range(steps):
        await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
        await asyncio.sleep(0.01)
    return "done"


@server.tool()
def attachments() -> list:
    """A resource link, a binary (gzip) resource and an image, as server-everything returns them."""
    import base64

    from mcp.types import BlobResourceContents, EmbeddedResource, ImageContent, ResourceLink

    return [ResourceLink(type="resource_link", uri="file:///data/report.csv", name="report.csv", mime_type="text/csv",
                         size=1234, description="the quarterly report"),
            EmbeddedResource(type="resource", resource=BlobResourceContents(
                uri="file:///data/notes.gz", mime_type="application/gzip", blob=base64.b64encode(b"x" * 20).decode())),
            ImageContent(type="image", data=base64.b64encode(b"\x89PNG" + b"0" * 60).decode(), mime_type="image/png")]


@server.tool()
def die() -> str:
    """Kill the server process mid-call (saying so on stderr first)."""
    print("demo server: dying now", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
