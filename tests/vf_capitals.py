"""A verifiers taskset written as verifiers' own examples are (reverse_text's rewards, glossary's toolset), with its
data inline so it runs offline: capitals looked up with a tool, answered in <answer> tags. Taskset id: "vf_capitals"
(tests/ on sys.path)."""

from __future__ import annotations

import re

import verifiers.v1 as vf

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima"}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class AtlasToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "atlas"

    @vf.tool
    def capital(self, country: str) -> str:
        """The capital city of a country."""
        return CAPITALS.get(country.strip().lower(), "unknown country")


class CapitalData(vf.TaskData):
    answer: str


class CapitalTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CapitalTask(vf.Task[CapitalData, vf.State, CapitalTaskConfig]):
    @classmethod
    def toolsets(cls, config: CapitalTaskConfig) -> list[vf.Toolset]:
        return [AtlasToolset(config.tools)]

    @vf.stop
    async def three_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 3

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = _ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip().lower() == self.data.answer.lower())

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class CapitalConfig(vf.TasksetConfig):
    task: CapitalTaskConfig = CapitalTaskConfig()
    countries: list[str] = list(CAPITALS)


class CapitalTaskset(vf.Taskset[CapitalTask, CapitalConfig]):
    def load(self) -> list[CapitalTask]:
        return [CapitalTask(CapitalData(idx=i, name=c, prompt=f"What is the capital of {c.title()}? Use the "
                                        "atlas_capital tool, then answer in <answer></answer> tags.",
                                        system_prompt="You are a geography assistant.", answer=CAPITALS[c]),
                            self.config.task)
                for i, c in enumerate(self.config.countries)]


__all__ = ["CapitalTaskset"]
