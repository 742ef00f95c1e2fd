"""What a run leaves in its `run_dir`, and the only part of the run that writes there.

- `config.json`: the run config as loaded;
- `metrics.jsonl`: one row per step (and step 0's evaluation, the warm-up's), also as TensorBoard scalars
  (`tensorboard/`, when tensorboard is installed);
- `samples.jsonl`: each step's first `sample_groups` groups, whole (the report's trajectory viewer);
- `checkpoints/step_N/` (the trainer's `save`, plus the batch source's state) and `checkpoints/latest`, the last
  `keep_last` of them kept (and every `keep_every`-th); a checkpoint is written under `step_N.partial/` and renamed
  when whole, then `latest` is replaced (atomically): a kill at any point leaves `latest` naming a whole checkpoint;
- `curves.png`, `summary.json`, `report.html` at the end.

`Recorder.step_metrics` adds a step's timing, engine-idle and rollout metrics to the trainer's; `line` is the log
line of a step.

A resumed run (`resume`) rolls every per-step record back to its checkpoint's step N with the weights: the rows of
`metrics.jsonl` and the groups of `samples.jsonl` of later steps are dropped (each file rewritten whole and renamed
over the old one), and TensorBoard hides the events after N (`purge_step`); the steps after N are then redone.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_env.rollout.metrics import time_split, tool_metrics

if TYPE_CHECKING:
    from slime_env.rollout import Group
    from slime_env.trajectory import Trajectory
    from slime_env.trainers.run.meter import BusyMeter
    from slime_env.trainers.run.roles import TrainerGroup


class Recorder:
    """The run directory of one run (see the module docstring)."""

    def __init__(self, run_dir: str | Path, *, sample_groups: int, log: Callable[[str], None], keep_last: int = 2,
                 keep_every: int = 0):
        self.run = Path(run_dir)
        self.metrics_path, self.samples_path = self.run / "metrics.jsonl", self.run / "samples.jsonl"
        self.checkpoints = self.run / "checkpoints"
        self.sample_groups, self.log = sample_groups, log
        self.keep_last, self.keep_every = keep_last, keep_every
        self.start = 0  # the step this run starts after (a resumed run's checkpoint)
        self.writer: Any = None
        self.t_start = self._t_prev = time.perf_counter()
        self._busy_prev = self._tokens_prev = 0.0
        self.t_rollout = self.t_sync = 0.0

    def open(self, document: Mapping[str, Any]) -> None:
        """Create the run directory and write `config.json`."""
        self.run.mkdir(parents=True, exist_ok=True)
        (self.run / "config.json").write_text(json.dumps(dict(document), indent=1, default=str))

    def begin(self, resume: bool) -> None:
        """Open TensorBoard. A run that starts at step 0 (not resumed, or resumed with no checkpoint) starts with no
        metrics, samples or events; a resumed one keeps those of the steps up to its checkpoint's (`resume`)."""
        if not resume or self.start == 0:
            self.metrics_path.unlink(missing_ok=True)
            self.samples_path.unlink(missing_ok=True)
            shutil.rmtree(self.run / "tensorboard", ignore_errors=True)
        self.writer = _tensorboard(self.run, purge_step=self.start + 1 if self.start else None)
        # A resumed run's clock goes on from its checkpoint's step: `time/elapsed_s`, the summary and
        # `time_budget_s` count the whole run (the time between a kill and the resume left out).
        self.t_start = time.perf_counter() - (self._elapsed_kept() if resume and self.start else 0.0)

    def _elapsed_kept(self) -> float:
        """`time/elapsed_s` of the last row kept (the checkpoint's step), 0 when there is none."""
        if not self.metrics_path.is_file():
            return 0.0
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        return max((float(r.get("time/elapsed_s", 0.0)) for r in rows), default=0.0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # --- checkpoints -----------------------------------------------------------------------------------------
    def resume(self, trainer: TrainerGroup) -> tuple[int, dict[str, Any]]:
        """Load the latest checkpoint into `trainer`: (its step, the batch source's saved state). The per-step
        records after that step are dropped (they are rolled back with the weights; see the module docstring).
        (0, {}) when there is none."""
        for partial in self.checkpoints.glob("*.partial"):  # a save a kill cut short
            shutil.rmtree(partial, ignore_errors=True)
        latest = self.checkpoints / "latest"
        if latest.exists():
            name = latest.read_text().strip()
            ckpt = self.checkpoints / name
            if not ckpt.exists() and (self.checkpoints / f"{name}.old").exists():  # killed while replacing it
                (self.checkpoints / f"{name}.old").rename(ckpt)
            trainer.load(ckpt)
            self.start = trainer.step_count
        state = {}
        if self.start:
            saved = ckpt / "async_state.json"
            state = json.loads(saved.read_text()) if saved.exists() else {}
            for path in (self.metrics_path, self.samples_path):
                _truncate_steps(path, self.start)
            self.log(f"resumed from {ckpt} (step {self.start})")
        return self.start, state

    def checkpoint(self, trainer: TrainerGroup, name: str, state: Mapping[str, Any] | None) -> Path:
        """Save the trainer under checkpoints/NAME (with the batch source's `state`, if any), point `latest` at it,
        and delete the checkpoints no longer kept (`keep_last`, `keep_every`)."""
        where, partial = self.checkpoints / name, self.checkpoints / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        trainer.save(partial)
        if state is not None:
            (partial / "async_state.json").write_text(json.dumps(dict(state)))
        old = self.checkpoints / f"{name}.old"
        if where.exists():  # the same step saved again (a run that ended at a step it had saved)
            shutil.rmtree(old, ignore_errors=True)
            where.rename(old)
        partial.rename(where)
        tmp = self.checkpoints / "latest.tmp"
        tmp.write_text(name)
        tmp.replace(self.checkpoints / "latest")  # atomic: a kill mid-write never leaves `latest` empty
        shutil.rmtree(old, ignore_errors=True)
        self._prune(name)
        return where

    def _prune(self, latest: str) -> None:
        """Delete the `step_N` checkpoints other than the last `keep_last`, every `keep_every`-th and `latest`."""
        steps = sorted(int(p.name[5:]) for p in self.checkpoints.glob("step_*") if p.name[5:].isdigit())
        keep = set(steps[-self.keep_last:]) | {s for s in steps if self.keep_every and s % self.keep_every == 0}
        for s in steps:
            if s not in keep and f"step_{s}" != latest:
                shutil.rmtree(self.checkpoints / f"step_{s}", ignore_errors=True)

    # --- rows --------------------------------------------------------------------------------------------------
    def record(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append the row of `step` to metrics.jsonl (and TensorBoard)."""
        row = {"step": step, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        return row

    def samples(self, step: int, groups: list[Group]) -> None:
        _save_samples(self.samples_path, step, groups[:max(self.sample_groups, 0)])

    # --- a step's timing ---------------------------------------------------------------------------------------
    def step_started(self, meter: BusyMeter) -> None:
        """A step (or the run's steps) starts now: the engine-idle and token counts restart here."""
        self._t_prev, self._busy_prev, self._tokens_prev = time.perf_counter(), meter.busy(), meter.tokens

    def step_metrics(self, metrics: Mapping[str, Any], trajectories: list[Trajectory], meter: BusyMeter, *,
                     rollout_s: float, sync_s: float) -> dict[str, Any]:
        """Time, idle shares and rollout counts of the step that ends now."""
        now = time.perf_counter()
        wall = max(now - self._t_prev, 1e-9)
        return {"rollout/s": rollout_s, "rollout/statuses": _statuses(trajectories),
                "time/elapsed_s": now - self.t_start, "time/step_s": wall, "time/sync_s": sync_s,
                "time/trainer_idle_frac": max(0.0, 1.0 - metrics.get("train/step_s", 0.0) / wall),
                "time/engine_idle_frac": max(0.0, 1.0 - (meter.busy() - self._busy_prev) / wall),
                "rollout/generated_tokens_per_s": (meter.tokens - self._tokens_prev) / wall,
                **_memory(), **time_split(trajectories), **tool_metrics(trajectories)}

    @staticmethod
    def line(step: int, metrics: Mapping[str, Any]) -> str:
        """The log line of a step."""
        return (f"step {step}: reward {metrics['train/reward_mean']:.3f}, loss {metrics.get('train/loss', 0):+.4f}, "
                f"grad {metrics.get('train/grad_norm', 0):.3f}, rollout {metrics['rollout/s']:.1f}s, train "
                f"{metrics['train/step_s']:.1f}s" + _container_part(metrics)
                + (f", {eval_line(metrics)}" if "eval/" in "".join(metrics) else ""))

    # --- the end -------------------------------------------------------------------------------------------------
    def finish(self, *, env: str, estimator: str, steps: int, games: bool) -> dict[str, Any]:
        """Curves, summary.json and the report of the rows written; the summary."""
        rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        curves = plot_curves(rows, self.run / "curves.png", f"{env} — {estimator}",
                             "win rate against the evaluation opponent (greedy)" if games
                             else "held-out accuracy (greedy)")  # zero-sum self-play: the mean reward is 0
        accs = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        summary = {"run_dir": str(self.run), "curves": str(curves), "metrics": str(self.metrics_path),
                   "first_accuracy": accs[0][1] if accs else math.nan,
                   "last_accuracy": accs[-1][1] if accs else math.nan,
                   "steps": steps, "elapsed_s": time.perf_counter() - self.t_start}
        warm = [r for r in rows if "warmup/steps" in r]
        if warm and "eval/accuracy" in warm[0]:
            summary["after_warmup_accuracy"] = warm[0]["eval/accuracy"]
        self.write_summary(summary)
        from slime_env.trainers.run.report import write_report

        summary["report"] = str(write_report(self.run))
        self.write_summary(summary)
        self.log(f"report: {summary['report']}")
        return summary

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        (self.run / "summary.json").write_text(json.dumps(summary, indent=1))


def eval_line(metrics: Mapping[str, Any]) -> str:
    """The log line's evaluation part: held-out accuracy, and each named set's accuracy and largest pass@k."""
    parts = [f"held-out accuracy {metrics['eval/accuracy']:.3f}"] if "eval/accuracy" in metrics else []
    for key in sorted(k for k in metrics if k.endswith("/accuracy") and k.count("/") == 2):
        name = key.split("/")[1]
        passes = sorted((int(k.rsplit("@", 1)[1]), k) for k in metrics if k.startswith(f"eval/{name}/pass@"))
        parts.append(f"{name} {metrics[key]:.3f}" + (f" (pass@{passes[-1][0]} {metrics[passes[-1][1]]:.3f})"
                                                      if passes else ""))
    return ", ".join(parts)


def plot_curves(rows: list[dict[str, Any]], path: Path, title: str,
                eval_label: str = "held-out accuracy (greedy)") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    ax.plot(steps, [r["train/reward_mean"] for r in rows if "train/reward_mean" in r], label="train reward (mean)",
            color="tab:blue", alpha=0.7)
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if ev:
        ax.plot([s for s, _ in ev], [a for _, a in ev], marker="o", label=eval_label,
                color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _truncate_steps(path: Path, last_step: int) -> None:
    """Keep the lines of a per-step JSONL file (metrics, samples) up to `last_step` (a resumed run redoes the later
    ones; a line a kill cut short goes too). The file is rewritten beside and renamed over the old one: a kill
    meanwhile leaves one or the other whole."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _save_samples(path: Path, step: int, groups: list[Group]) -> None:
    """This step's first groups, whole, for the report's trajectory viewer."""
    if not groups:
        return
    with path.open("a", encoding="utf-8") as f:
        for g in groups:
            f.write(json.dumps({**g.to_record(), "step": step}, ensure_ascii=False) + "\n")


def _statuses(trajs) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trajs:
        out[t.status] = out.get(t.status, 0) + 1
    return out


def _tensorboard(run: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: metrics.jsonl and the PNG still get written
        return None
    return SummaryWriter(str(run / "tensorboard"), purge_step=purge_step)


def _container_part(metrics: Mapping[str, Any]) -> str:
    """The episodes' time split when they ran in workspaces: generation vs container (start, commands, scoring)."""
    if "rollout/time/container_frac" not in metrics:
        return ""
    return (f" (episode time: generation {metrics['rollout/time/generate_frac']:.0%}, "
            f"container {metrics['rollout/time/container_frac']:.0%})")


def _memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, in MB (`memory/rss_mb`, `memory/peak_mb`): a run whose
    memory grows step after step shows it here (Linux; nothing elsewhere). `memory/malloc_free_mb`: what malloc holds
    freed among it (glibc; `slime_env.malloc_tuning`), to tell memory the run keeps from memory the allocator does."""
    import resource

    from slime_env.malloc_tuning import malloc_free_bytes

    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return {}
    free = malloc_free_bytes()
    return {"memory/rss_mb": round(rss, 1), "memory/peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                     / 1024, 1),
            **({} if free is None else {"memory/malloc_free_mb": round(free / 2**20, 1)})}
