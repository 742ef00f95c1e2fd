"""Two agents, one ledger each: tic-tac-toe between two scripted players, rock-paper-scissors with
simultaneous moves, and a seat played by the env's own bot.

    python examples/multi_agent_game.py
"""

import asyncio
import re

from slime_env.envs.games import RockPaperScissorsEnv, TicTacToeEnv

from slime_env import ScriptedPolicy, get_renderer, run_multi_agent_episode
from slime_env.offline_tokenizers import smollm2


def first_free_cell(context: str) -> str:
    """Reads the last board the agent was shown and takes its first free cell."""
    rows = re.findall(r"Board:\n([^\n]+)\n([^\n]+)\n([^\n]+)", context)[-1]
    free = [c for row in rows for c in row.split() if c.isdigit()]
    return f"<move>{free[0]}</move>"


async def main() -> None:
    tok = smollm2()
    renderer = get_renderer(tok, strict=True)  # every agent's ids checked against a full render of its chat
    player = ScriptedPolicy(tok, first_free_cell)

    trajs = await run_multi_agent_episode(TicTacToeEnv(), player, "play", renderer=renderer)  # self-play
    for agent, t in trajs.items():
        print(f"tic-tac-toe {agent}: status={t.status} reward={t.reward:+.0f} turns={t.num_turns} "
              f"generated={sum(t.loss_mask)} inserted={len(t.loss_mask) - sum(t.loss_mask)} tokens")
    print("moves:", trajs["x"].info["moves"])

    rock = ScriptedPolicy(tok, ["<move>rock</move>"])
    cycle = ScriptedPolicy(tok, ["<move>paper</move>", "<move>scissors</move>", "<move>rock</move>"])
    rps = await run_multi_agent_episode(RockPaperScissorsEnv(rounds=3), {"player_0": rock, "player_1": cycle},
                                        "play", renderer=renderer)
    print("rock-paper-scissors per-round rewards:", {a: t.turn_rewards for a, t in rps.items()})

    vs_bot = await run_multi_agent_episode(TicTacToeEnv(bot={"o": "perfect"}), player, "play", renderer=renderer)
    print(f"against the perfect bot: reward {vs_bot['x'].reward:+.0f} ({vs_bot['x'].info['moves']})")


if __name__ == "__main__":
    asyncio.run(main())
