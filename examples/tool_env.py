"""A tool-use env in ~20 lines: typed Python functions become tools, a rubric scores the final answer.

Run it: `python examples/tool_env.py` (a scripted policy plays one episode and prints the ledger).
Train on it: `slime-env train --config examples/tool_env.yaml` (the env is `examples/tool_env.py:make_env`).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from slime_env import Rubric, ToolEnv
from slime_env.tool_env import answer_format, exact_answer

Unit = Literal["m", "km", "mi"]
METERS = {"m": 1.0, "km": 1000.0, "mi": 1609.344}
ROADS_KM = {frozenset({"Lyon", "Paris"}): 465.0, frozenset({"Lyon", "Nice"}): 470.0,
            frozenset({"Paris", "Lille"}): 225.0, frozenset({"Lyon", "Geneva"}): 150.0}


def convert(value: float, from_unit: Unit, to_unit: Unit) -> float:
    """Convert a distance between units.

    Args:
        value: the distance
        from_unit: its unit
        to_unit: the unit wanted
    """
    return round(value * METERS[from_unit] / METERS[to_unit], 1)


async def road_distance(city_a: str, city_b: str) -> float:
    """Road distance between two cities, in km.

    Args:
        city_a: one city
        city_b: the other city
    """
    return ROADS_KM[frozenset({city_a, city_b})]  # an unknown pair: KeyError, shown to the model as an error


def tasks(n: int = 64, seed: int = 0) -> list[dict]:
    """Questions whose answers need both tools: a road distance, converted (the train config's generator)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = sorted(rng.choice(list(ROADS_KM)))
        unit = rng.choice(["m", "mi"])
        answer = convert(ROADS_KM[frozenset({a, b})], "km", unit)
        out.append({"prompt": f"How far is it by road from {a} to {b}, in {unit}?", "label": str(answer)})
    return out


TASKS = [{"prompt": "How many miles is it by road from Paris to Lyon, then on to Nice?", "label": "581.0"}]


def make_env(**kwargs) -> ToolEnv:
    return ToolEnv([convert, road_distance], rubric=Rubric(exact_answer, (answer_format, 0.1)),
                   tasks=kwargs.pop("tasks", TASKS), max_turns=kwargs.pop("max_turns", 6), **kwargs)


async def main() -> None:
    from slime_env import ScriptedPolicy, get_renderer, run_episode
    from slime_env.offline_tokenizers import smollm2

    tok = smollm2()
    replies = [  # two calls in one turn run concurrently; the third turn converts; the fourth answers
        '<tool_call>{"name": "road_distance", "arguments": {"city_a": "Paris", "city_b": "Lyon"}}</tool_call>\n'
        '<tool_call>{"name": "road_distance", "arguments": {"city_a": "Lyon", "city_b": "Nice"}}</tool_call>',
        '<tool_call>{"name": "convert", "arguments": {"value": 935, "from_unit": "km", "to_unit": "miles"}}'
        '</tool_call>',
        '<tool_call>{"name": "convert", "arguments": {"value": 935, "from_unit": "km", "to_unit": "mi"}}</tool_call>',
        "About <answer>581.0</answer> miles."]
    env = make_env()
    traj = await run_episode(env, ScriptedPolicy(tok, replies), TASKS[0], renderer=get_renderer(tok, strict=True))
    print("schema of convert:", env.tools[0]["function"]["parameters"]["properties"]["to_unit"])
    for m in traj.messages:
        if m.role == "tool":
            print(f"tool {m.name} [{m.tool_call_id}]: {m.content}")
    print(f"status={traj.status} reward={traj.reward} turns={traj.num_turns} rubric={traj.info['rubric']}")
    print("tool stats:", {k: (v["calls"], v["invalid"]) for k, v in traj.info["tool_stats"].items()})


if __name__ == "__main__":
    asyncio.run(main())
