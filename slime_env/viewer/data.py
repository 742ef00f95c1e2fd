"""Reading what the viewer shows: rollout stores, trajectory files, training runs — bad lines reported, never fatal.

Every input becomes a list of episode records (plain dicts, one per trajectory) plus warnings that name
the file and line of each problem; a line that cannot be read is skipped and everything else is shown.
Accepted: a rollout directory (`groups.jsonl`), a `slime-env train` run directory (`samples.jsonl`), a
JSONL file of group records, of trajectories (`Trajectory.to_dict`) or of flat rows, and Parquet files
(`batch-*.parquet` rows or trajectory columns). Older records without spans, messages or agent ids
are accepted: spans are derived from the loss mask.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("generated", "inserted", "offpolicy")


@dataclass
class Loaded:
    """Episodes (viewer records) and the problems met reading them (`file:line: what`)."""

    episodes: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    tokenizer_hint: str | None = None


def load(path: str | Path) -> Loaded:
    """Everything viewable under `path` (see the module docstring)."""
    path = Path(path)
    out = Loaded()
    if not path.exists():
        out.warnings.append(f"{path}: no such file or directory")
        return out
    files: list[Path]
    if path.is_dir():
        out.tokenizer_hint = _tokenizer_hint(path)
        files = [p for p in (path / "groups.jsonl", path / "samples.jsonl") if p.exists()]
        if not files:
            files = sorted(path.glob("*.jsonl")) + sorted(path.glob("*.parquet"))
        if not files:
            out.warnings.append(f"{path}: holds no groups.jsonl, samples.jsonl, *.jsonl or *.parquet")
    else:
        files = [path]
    for f in files:
        out.sources.append(str(f))
        before = len(out.episodes)
        rows = _parquet_rows(f, out.warnings) if f.suffix == ".parquet" else _jsonl_rows(f, out.warnings)
        for where, row in rows:
            _add(row, where, out)
        if len(out.episodes) == before and not any(w.startswith(f"{f}:") for w in out.warnings):
            out.warnings.append(f"{f}: empty: no episodes")
    _advantages(out.episodes)
    for i, ep in enumerate(out.episodes):
        ep["i"] = i
    return out


def _tokenizer_hint(directory: Path) -> str | None:
    """The model a run directory was trained with, or the tokenizer a rollout directory names."""
    for name, key in (("config.json", "model"), ("manifest.json", "tokenizer")):
        try:
            data = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        value = data.get(key) if key in data else (data.get("config") or {}).get(key)
        if isinstance(value, str):
            return value
    return None


def _jsonl_rows(path: Path, warnings: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        warnings.append(f"{path}: cannot read: {e}")
        return
    if not raw.strip():
        warnings.append(f"{path}: empty file: no episodes")
        return
    lines = raw.split(b"\n")
    last = len(lines) - (1 if raw.endswith(b"\n") else 0)
    for n, line in enumerate(lines[:last], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if n == last and not raw.endswith(b"\n"):
                warnings.append(f"{path}:{n}: truncated last line (the writer stopped mid-line?); skipped")
            else:
                warnings.append(f"{path}:{n}: not valid JSON ({e}); skipped")
            continue
        if not isinstance(row, dict):
            warnings.append(f"{path}:{n}: expected a JSON object, got {type(row).__name__}; skipped")
            continue
        yield f"{path}:{n}", row


def _parquet_rows(path: Path, warnings: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - a broken file is reported, the others are shown
        warnings.append(f"{path}: cannot read Parquet: {type(e).__name__}: {e}")
        return
    for n, row in enumerate(rows, 1):
        yield f"{path}:row {n}", row


def _add(row: dict[str, Any], where: str, out: Loaded) -> None:
    if isinstance(row.get("trajectories"), list):  # a group record (rollout store, train samples)
        group = {k: row.get(k) for k in ("group_index", "env_id", "accepted", "filter_reason", "step")}
        for k, traj in enumerate(row["trajectories"]):
            if not isinstance(traj, dict):
                out.warnings.append(f"{where}: trajectory {k} is not an object; skipped")
                continue
            _add_one(traj, f"{where} trajectory {k}", group, out)
        return
    _add_one(row, where, {"group_index": row.get("group_index"), "env_id": row.get("env_id"),
                          "step": row.get("step")}, out)


def _add_one(t: dict[str, Any], where: str, group: dict[str, Any], out: Loaded) -> None:
    try:
        ep = _episode(t, where, group, out.warnings)
    except (KeyError, TypeError, ValueError) as e:
        out.warnings.append(f"{where}: not a trajectory ({type(e).__name__}: {e}); skipped")
        return
    out.episodes.append(ep)


def _episode(t: dict[str, Any], where: str, group: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    import numpy as np  # a store holds millions of ids: convert and round them in bulk

    prompt = np.asarray(t["prompt_ids"], dtype=np.int64).tolist()
    response = np.asarray(t["response_ids"], dtype=np.int64).tolist()
    mask = np.asarray(t.get("loss_mask") or [1] * len(response), dtype=np.int64).tolist()
    lps = np.round(np.asarray(t.get("rollout_logprobs") or [0.0] * len(response), dtype=np.float64), 4).tolist()
    if len(mask) != len(response) or len(lps) != len(response):
        raise ValueError(f"{len(response)} response ids but {len(mask)} mask values and {len(lps)} log-probs")
    spans = t.get("spans")
    if spans is None:
        warnings.append(f"{where}: older record format (no 'spans'); token kinds derived from the loss mask")
        spans = _spans_from_mask(mask)
    shown_spans = []
    for s in spans:
        kind = str(s.get("kind"))
        if kind not in KINDS:
            warnings.append(f"{where}: unknown span kind {kind!r} (tokens {s.get('start')}..{s.get('end')}); "
                            "shown as 'unknown'")
            kind = "unknown"
        shown_spans.append([int(s.get("turn", 0)), kind, int(s["start"]), int(s["end"])])
    task = t.get("task") or {}
    md = t.get("metadata") or {}
    prompt_text = task.get("prompt") if isinstance(task, dict) else None
    if isinstance(prompt_text, list):
        prompt_text = " ".join(str(m.get("content", "")) for m in prompt_text if isinstance(m, dict))
    messages = t.get("messages")
    if messages is None:
        messages = []
    drift = [str(x) for x in md.get("history_rewrites") or []]
    reason = str(t.get("reason") or "")
    if "RenderMismatch" in reason:
        drift.append(reason)
    status = str(t.get("status") or "completed")
    reward = _num(t.get("reward"), 0.0)
    return {
        "where": where, "env": group.get("env_id") or md.get("env_id") or "", "group": group.get("group_index"),
        "step": group.get("step"), "accepted": group.get("accepted", True), "agent": t.get("agent_id") or "agent",
        "episode_id": md.get("episode_id"), "role": md.get("role"), "status": status, "reason": reason,
        "reward": reward, "turn_rewards": [_num(x, 0.0) for x in t.get("turn_rewards") or []],
        "num_turns": int(t.get("num_turns") or 0), "task_id": (task.get("id") if isinstance(task, dict) else None)
        or t.get("task_id"), "prompt": str(prompt_text or "")[:300],
        "label": _short(task.get("label") if isinstance(task, dict) else None),
        "messages": [{k: m.get(k) for k in ("role", "content", "name", "tool_call_id") if m.get(k) is not None}
                     for m in messages if isinstance(m, dict)],
        "prompt_ids": prompt, "response_ids": response, "mask": mask,
        "logprobs": lps, "spans": shown_spans,
        "timings": {k: round(_num(v, 0.0), 4) for k, v in (t.get("timings") or {}).items()},
        "info": _short(t.get("info") or {}), "drift": drift, "length": len(response),
        "generated": sum(mask), "index": md.get("index", t.get("index")),
    }


def _spans_from_mask(mask: list[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, m in enumerate(mask):
        kind = "generated" if m else "inserted"
        if spans and spans[-1]["kind"] == kind:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"turn": 0, "kind": kind, "start": i, "end": i + 1})
    return spans


def _num(value: Any, default: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return default
    return x if math.isfinite(x) else default


def _short(value: Any, limit: int = 2000) -> Any:
    """JSON-able and bounded: the page must stay light whatever an env put in its info."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = json.dumps(str(value))
    if len(text) <= limit:
        return json.loads(text)
    return text[:limit] + f"... [{len(text) - limit} characters cut]"


def _advantages(episodes: list[dict[str, Any]]) -> None:
    """GRPO's group-normalised advantage (reward - mean) / std per (step, env, group, agent), for the group view."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for ep in episodes:
        if ep["group"] is not None:
            groups[(ep["step"], ep["env"], ep["group"], ep["agent"])].append(ep)
    for members in groups.values():
        rewards = [m["reward"] for m in members]
        mean = statistics.fmean(rewards)
        std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
        for m in members:
            m["advantage"] = round((m["reward"] - mean) / (std + 1e-6), 4)
