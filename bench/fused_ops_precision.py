"""How far the paged engine's fused elementwise kernels move greedy log-probs from the model's own forward (GPU).

SmolLM2-135M-Instruct in float32 on CUDA, 24 prompts x 40 greedy tokens through the paged engine; each generated
token's log-prob against a teacher-forced forward of the whole sequence. Rows: no fused kernel (the model's
modules: exact), then each of the three fused kernels (`slime_env.agents.fused_ops`) alone, then all three, the others
replaced by torch functions of the modules' arithmetic. Measured 2026-11-24 on an H100 (all three fused: max 0.10,
p99 0.03; the Triton attention kernels alone: exact) — the reason the engine fuses only 16-bit models. Which
kernel drifts is what this script answers.

    python bench/fused_ops_precision.py
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import slime_env.agents.fused_ops as fo  # noqa: E402
import slime_env.agents.paged_attention as pa  # noqa: E402
from slime_env.agents.default_model import load_default_model  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

from slime_env import Message, get_renderer  # noqa: E402

NAMES = {"norm": "add_rms_norm", "rope": "rope_store", "silu": "silu_mul"}
FUSED = {k: getattr(fo, v) for k, v in NAMES.items()}


def torch_norm(x, delta, w, eps):
    res = x if delta is None else x + delta
    xf = res.float()
    return res, w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rope(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps):
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    if q_norm is not None:
        q.copy_(q_norm * (q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + eps)).to(q.dtype))
        k = k_norm * (k.float() * torch.rsqrt(k.float().pow(2).mean(-1, keepdim=True) + eps)).to(k.dtype)
    c, s = cos[:, None], sin[:, None]
    q.copy_(q * c + rot(q) * s)
    pa.store(k_cache, v_cache, k * c + rot(k) * s, v, slots)


TORCH = {"norm": torch_norm, "rope": torch_rope, "silu": lambda g, u: F.silu(g) * u}


def gaps(model, tok, prompts, fused: set[str]) -> list[float]:
    for key, name in NAMES.items():
        setattr(fo, name, FUSED[key] if key in fused else TORCH[key])
    policy = TransformersPolicy(model, tok, max_batch_size=32, paged=True, paged_options={"cuda_graphs": False})
    policy._engine.runner.fused = bool(fused)

    async def main():
        return await asyncio.gather(*(policy.generate(p, {"temperature": 0.0, "max_new_tokens": 40}) for p in prompts))

    try:
        gens = asyncio.run(main())
    finally:
        policy.close()
    out = []
    with torch.inference_mode():
        for p, g in zip(prompts, gens):
            logits = model(torch.tensor([p + list(g.token_ids)], device="cuda")).logits[0, len(p) - 1:-1].float()
            lp = torch.log_softmax(logits, -1)
            out += [abs(float(lp[j, t]) - g.logprobs[j]) for j, t in enumerate(g.token_ids)]
    return sorted(out)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_default_model("cuda", torch.float32)
    renderer = get_renderer(tok)
    prompts = [renderer.render_prompt([Message("user", f"Question {i}: what is {i} + {2 * i}? Explain.")])
               for i in range(24)]
    print(f"{torch.cuda.get_device_name()}, SmolLM2-135M-Instruct float32, 24 x 40 greedy tokens")
    print(f"{'fused kernels':24} {'max gap':>8} {'p99':>8} {'median':>10}")
    for fused in (set(), {"norm"}, {"rope"}, {"silu"}, {"norm", "rope", "silu"}):
        g = gaps(model, tok, prompts, fused)
        print(f"{', '.join(sorted(fused)) or 'none (modules)':24} {g[-1]:>8.4f} {g[int(len(g) * .99)]:>8.4f} "
              f"{g[len(g) // 2]:>10.6f}", flush=True)


if __name__ == "__main__":
    main()
