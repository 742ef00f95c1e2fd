"""The training report: one self-contained `report.html` per `slime-env train` run.

Curves (train reward, held-out accuracy, response length, KL, entropy, clip fraction, status counts, rollout
vs train time, tool calls) drawn from `metrics.jsonl` as inline PNGs, the run's summary and config, and the
trajectories sampled at the first and last steps (`samples.jsonl`) in the trajectory viewer below them.
Written at the end of every run and on demand with `slime-env report RUN_DIR`.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput

CURVES = (  # (title, [(metric, label)])
    ("Reward", [("train/reward_mean", "train reward (mean)"), ("eval/reward_mean", "held-out reward (greedy)")]),
    ("Held-out accuracy", [("eval/accuracy", "accuracy / win rate (greedy)")]),
    ("Response length", [("train/response_len", "tokens per response (mean)")]),
    ("KL", [("train/kl", "KL to the reference")]),
    ("Entropy", [("train/entropy", "entropy (mean per token)")]),
    ("Clip fraction", [("train/clip_frac", "clipped ratio fraction")]),
    ("Time per step", [("rollout/s", "rollout s"), ("train/step_s", "train s")]),
    ("Episode time", [("rollout/time/generate_frac", "generation share"), ("rollout/time/env_frac", "env share"),
                      ("rollout/time/container_frac", "container share (workspaces)")]),
)


STATUS_COLOURS = {"completed": "#3a9d3a", "truncated": "#e0a526", "aborted": "#9a9a9a", "failed": "#d03b3b",
                  "infra_error": "#7b4fa0"}


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise InvalidInput(f"{run}: no metrics.jsonl (is this a `slime-env train` run directory?)")
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash: the curves use the rest
    return rows


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def curve_images(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One PNG (as a data: URI) per curve that has data, plus status counts and tool calls per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []

    from matplotlib.ticker import MaxNLocator

    def finish(fig, ax, title: str) -> None:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        images.append({"title": title, "src": _png(fig)})
        plt.close(fig)

    for title, series in CURVES:
        present = [(key, label) for key, label in series if any(_finite(r.get(key)) for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(4.6, 2.9))
        for key, label in present:
            points = [(r["step"], r[key]) for r in rows if _finite(r.get(key))]
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
        finish(fig, ax, title)
    statuses = [(r["step"], r["rollout/statuses"]) for r in rows if isinstance(r.get("rollout/statuses"), dict)]
    if statuses:
        fig, ax = plt.subplots(figsize=(4.6, 2.9))
        names = sorted({k for _, s in statuses for k in s})
        bottom = [0.0] * len(statuses)
        for name in names:
            values = [float(s.get(name, 0)) for _, s in statuses]
            ax.bar([st for st, _ in statuses], values, bottom=bottom, label=name, color=STATUS_COLOURS.get(name))
            bottom = [b + v for b, v in zip(bottom, values)]
        finish(fig, ax, "Episode statuses")
    tools = sorted({k.split("/")[2] for r in rows for k in r
                    if k.startswith("rollout/tools/") and k.endswith("/calls")})
    if tools:
        fig, ax = plt.subplots(figsize=(4.6, 2.9))
        for name in tools:
            points = [(r["step"], r[f"rollout/tools/{name}/calls"]) for r in rows if f"rollout/tools/{name}/calls" in r]
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=f"{name} calls")
        finish(fig, ax, "Tool calls")
    return images


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def write_report(run_dir: str | Path, out: str | Path | None = None, *, tokenizer: Any = None) -> Path:
    """Write `report.html` for a run directory (or `out`); returns its path."""
    from slime_env.viewer import NAMED_TOKENIZERS, render_html
    from slime_env.viewer.data import Loaded, load

    run = Path(run_dir)
    rows = _rows(run)
    config = _json(run / "config.json")
    summary = _json(run / "summary.json")
    samples = run / "samples.jsonl"
    loaded = load(samples) if samples.exists() else Loaded()
    steps = sorted({e["step"] for e in loaded.episodes if e["step"] is not None})
    if steps:  # the first and the last step only: what changed
        keep = {steps[0], steps[-1]}
        loaded.episodes = [e for e in loaded.episodes if e["step"] in keep]
        for i, e in enumerate(loaded.episodes):
            e["i"] = i
    if tokenizer is None:
        model = config.get("model")
        tokenizer = "default" if model in (None, "default") else (model if model in NAMED_TOKENIZERS
                                                                 or Path(str(model)).is_dir() else "default")
    first = next((r["eval/accuracy"] for r in rows if _finite(r.get("eval/accuracy"))), None)
    last = next((r["eval/accuracy"] for r in reversed(rows) if _finite(r.get("eval/accuracy"))), None)
    facts = {"run": str(run), "env": config.get("env"), "model": config.get("model"),
             "estimator": (config.get("trainer") or {}).get("estimator", "grpo"),
             "steps": max((r["step"] for r in rows), default=0),
             "held-out accuracy": f"{first:.3f} → {last:.3f}" if first is not None and last is not None else "–",
             "elapsed": f"{summary['elapsed_s']:.0f} s" if _finite(summary.get("elapsed_s")) else "–",
             "trajectories shown": (f"steps {', '.join(map(str, sorted({steps[0], steps[-1]})))}" if steps
                                    else "none saved")}
    html_text = render_html(loaded, tokenizer, title=f"Training report: {run.name}",
                            extra={"report": {"facts": facts, "images": curve_images(rows), "config": config}})
    target = Path(out) if out is not None else run / "report.html"
    target.write_text(html_text, encoding="utf-8")
    return target


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["curve_images", "write_report"]
