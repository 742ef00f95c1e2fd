"""An env of ours served as an OpenEnv environment, and played back through OpenEnv's client as an env of ours.

`slime-env serve-openenv Calculator-v0` starts OpenEnv's own server over our env; `OpenEnvEnv(url)` is any OpenEnv
environment as a slime_env env. A scripted policy plays one episode each way round; the ledgers are equal.
Needs `pip install 'slime_env[openenv]'`. Run: `python -P examples/openenv_roundtrip.py`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from slime_env import ScriptedPolicy, get_renderer, make, run_episode
from slime_env.integrations.openenv import OpenEnvEnv
from slime_env.offline_tokenizers import smollm2

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(32 + 77) * 19"}}\n</tool_call>'
TASK = {"prompt": "What is (32 + 77) * 19?", "label": "2071"}


async def main(url: str) -> None:
    tok = smollm2()
    renderer = get_renderer(tok, strict=True)
    replies = [CALL, "<answer>2071</answer>"]
    remote = OpenEnvEnv(url, tools=False, action="text", send_task=True)  # our server: the task travels with reset
    through_openenv = await run_episode(remote, ScriptedPolicy(tok, replies), TASK, renderer=renderer)
    await remote.close()
    direct = await run_episode(make("Calculator-v0"), ScriptedPolicy(tok, replies), TASK, renderer=renderer)
    print(f"through OpenEnv: status={through_openenv.status} reward={through_openenv.reward}")
    print(f"direct:          status={direct.status} reward={direct.reward}")
    print("same ledger:", through_openenv.tokens == direct.tokens and through_openenv.loss_mask == direct.loss_mask)


if __name__ == "__main__":
    server = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-openenv", "Calculator-v0", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[-1]  # "listening on http://127.0.0.1:PORT"
        asyncio.run(main(url))
    finally:
        server.terminate()
        server.wait(timeout=30)
