"""A multi-turn verifiers env written as verifiers' color-codeword is (its `run()` reveals letters turn by turn through
`interaction.turn`), text only and offline. Taskset id: "vf_codeword"."""

from __future__ import annotations

import verifiers.v1 as vf


class CodewordData(vf.TaskData):
    answer: str
    reveals: list[str]


class CodewordTask(vf.Task[CodewordData]):
    @vf.reward(weight=2.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().upper() == self.data.answer)

    @vf.metric
    async def partial(self, trace: vf.Trace) -> float:
        got = trace.last_reply.strip().upper()
        return sum(a == b for a, b in zip(got, self.data.answer)) / len(self.data.answer)


class CodewordEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class CodewordEnv(vf.Env[CodewordEnvConfig]):
    async def run(self, task, agents):
        reveals = task.data.reveals
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn(f"Letters so far: {reveals[0]}. Reply with the codeword so far.")
            for letters in reveals[1:]:
                if segment.terminated:
                    break
                segment = await interaction.turn(f"More letters: {letters}. Reply with the whole codeword so far.")
        interaction.trace.record_reward("finished", float(not segment.terminated), 0.5)


class CodewordTaskset(vf.Taskset[CodewordTask, vf.TasksetConfig]):
    def load(self) -> list[CodewordTask]:
        words = [["AB", "CD"], ["XY", "Z"], ["Q", "R", "S"]]
        return [CodewordTask(CodewordData(idx=i, answer="".join(w), reveals=w,
                                          system_prompt="Accumulate the letters you are shown."), self.config.task)
                for i, w in enumerate(words)]


__all__ = ["CodewordEnv", "CodewordTaskset"]
