"""Search-v0 end to end, offline: a BM25 index over the demo corpus, served with Search-R1's API, and one
scripted episode (search -> information -> answer) against it.

    python examples/search_env.py
"""

import asyncio
import tempfile

from slime_env.envs.search import BM25Retriever, RemoteRetriever, demo_corpus, demo_questions
from slime_env.envs.search.server import make_app

import slime_env
from slime_env import ScriptedPolicy, get_renderer, run_episode
from slime_env.offline_tokenizers import smollm2


async def main() -> None:
    from aiohttp import web

    with tempfile.TemporaryDirectory() as tmp:
        retriever = BM25Retriever(BM25Retriever.build(demo_corpus(), tmp))
        runner = web.AppRunner(make_app(retriever))  # what `slime-env serve-retriever` runs
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        question = demo_questions(1, seed=3)[0]
        quote = question["question"].split('says: "', 1)[1].rstrip('"')
        tok = smollm2()
        policy = ScriptedPolicy(tok, [f"<think>Find the section.</think><search>{quote}</search>",
                                      f"<answer>{question['answers'][0]}</answer>"])
        remote = RemoteRetriever(url)
        env = slime_env.make("Search-v0", retriever=remote)
        traj = await run_episode(env, policy, {"prompt": question["question"], "label": question["answers"]},
                                 renderer=get_renderer(tok), max_turns=4)
        information = tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
        print(f"question: {question['question'][:90]}...")
        print(f"searched: {env.searches}")
        print(f"information (masked): {information.strip()[:160]}...")
        print(f"status={traj.status} reward={traj.reward} golds={question['answers']}")
        await remote.close()
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
