"""MCP servers nobody on the team wrote, over stdio: the reference servers `@modelcontextprotocol/server-everything`
and `@modelcontextprotocol/server-memory` from the npm registry (`.ci/host-deps` installs node and both; without
them these tests skip with the reason, except in CI, where they fail)."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

pytest.importorskip("mcp", reason="the [mcp] extra is not installed")

from slime_env import ToolEnv  # noqa: E402
from slime_env.integrations.mcp import MCPServer  # noqa: E402
from slime_env.types import Action, ToolCall  # noqa: E402


def _server(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed: .ci/host-deps installs it (npm install -g)")
        pytest.skip(f"{binary} is not installed (npm install -g @modelcontextprotocol/{binary[4:]})")
    return path


async def _turn(env: ToolEnv, *calls: tuple[str, dict]) -> list[str]:
    obs, *_ = await env.step(Action("..", tool_calls=tuple(ToolCall(n, a) for n, a in calls)))
    return [m.content for m in obs]


def test_server_everything_resource_links_blobs_images_and_task_only_tools():
    """Links and binary resources reach the model with their URI, name and MIME type; the raw blocks stay on the
    call's record; the tool that can only be called task-augmented is not offered, and the env's info says why."""
    binary = _server("mcp-server-everything")

    async def main():
        async with MCPServer([binary], timeout_s=30) as server:
            env = ToolEnv([server])
            _, info = await env.reset(options={"task": {"prompt": "q"}})
            links, = await _turn(env, ("get-resource-links", {"count": 2}))
            links_record = env.tool_history[-1]
            blob, = await _turn(env, ("get-resource-reference", {"resourceType": "Blob", "resourceId": 2}))
            image, = await _turn(env, ("get-tiny-image", {}))
            names = env.tool_names
            await env.close()
            return info, names, links, links_record, blob, image

    info, names, links, record, blob, image = asyncio.run(main())
    assert "simulate-research-query" not in names and "echo" in names
    assert "taskSupport is 'required'" in info["skipped_tools"]["simulate-research-query"]
    assert "[resource link Blob Resource 1 <demo://resource/dynamic/blob/1> (text/plain)" in links
    blocks = record.data["content"]
    assert [b["type"] for b in blocks[1:]] == ["resource_link", "resource_link"]
    assert blocks[1]["uri"] == "demo://resource/dynamic/blob/1" and record.to_dict()["data"] == record.data
    assert "[binary resource demo://resource/dynamic/blob/2 (text/plain, " in blob and "bytes)]" in blob
    assert "[image (image/png, " in image and "bytes)]" in image


def test_server_memory_keeps_a_turns_entities_and_relations_under_a_concurrency_limit(tmp_path):
    """server-memory writes its file without a lock, so concurrent calls of one turn can lose each other's writes;
    with `max_concurrency=1` the turn's calls reach it one at a time and the graph keeps both."""
    binary = _server("mcp-server-memory")

    async def main():
        server = MCPServer([binary], timeout_s=30, max_concurrency=1,
                           env={**os.environ, "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")})
        async with server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            entity = {"entities": [{"name": "Ada", "entityType": "person", "observations": ["wrote a program"]},
                                   {"name": "Engine", "entityType": "machine", "observations": ["analytical"]}]}
            relation = {"relations": [{"from": "Ada", "to": "Engine", "relationType": "programmed"}]}
            made = await _turn(env, ("create_entities", entity), ("create_relations", relation))
            graph, = await _turn(env, ("read_graph", {}))
            await env.close()
            return made, graph

    made, graph = asyncio.run(main())
    assert not any(m.startswith("error") for m in made), made
    assert '"Ada"' in graph and '"Engine"' in graph and '"programmed"' in graph
