"""Visual envs (images in observations): `VisualReasoning-v0` (count, bars, clock, chart; one turn) and
`VisualSearch-v0` (zoom into a large picture; the tool returns an image). Pictures are drawn with Pillow from
(kind, seed); see `slime_env.envs.vision.env` and docs/vlm.md."""

from slime_env.envs.vision.env import VisualReasoningEnv, VisualSearchEnv, extract_answer, visual_tasks

__all__ = ["VisualReasoningEnv", "VisualSearchEnv", "extract_answer", "visual_tasks"]
