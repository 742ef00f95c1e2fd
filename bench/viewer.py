"""How fast a big rollout store opens in the viewer (target: 10,000 episodes in seconds).

Writes a rollout store of N synthetic episodes (groups of 8, T response tokens each, real SmolLM2 token ids,
a tool-call turn structure), then measures in one run: reading the store with `json` alone (the floor),
`slime-env view` building the page, and headless Chromium opening the page until it is ready, opening an
episode's token strip, and filtering the list. The baseline beside it is the same page with every row put
in the DOM at once (what a viewer without paging does).

    python bench/viewer.py [--episodes 10000] [--tokens 400]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # its support modules

from slime_env.viewer import build_view  # noqa: E402
from viewer_support import browser, open_page  # noqa: E402


def write_store(directory: Path, episodes: int, tokens: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = list(range(200, 20000))
    prompt = [1, 9690, 198] + [rng.choice(vocab) for _ in range(60)] + [2, 198, 1, 520, 9531, 198]
    with (directory / "groups.jsonl").open("w") as f:
        for g in range(episodes // 8):
            trajs = []
            for k in range(8):
                response = [rng.choice(vocab) for _ in range(tokens)]
                cut = tokens // 3
                mask = [1] * cut + [0] * 40 + [1] * (tokens - cut - 40)
                spans = [{"turn": 0, "kind": "generated", "start": 0, "end": cut},
                         {"turn": 0, "kind": "inserted", "start": cut, "end": cut + 40},
                         {"turn": 1, "kind": "generated", "start": cut + 40, "end": tokens}]
                reward = float(rng.random() < 0.4)
                trajs.append({"task": {"prompt": f"question {g}", "label": "42", "metadata": {}, "id": f"t{g}"},
                              "prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
                              "rollout_logprobs": [round(-rng.random() * 3, 3) if m else 0.0 for m in mask],
                              "spans": spans, "turn_rewards": [0.0, reward], "reward": reward,
                              "status": rng.choice(["completed"] * 8 + ["truncated", "failed"]), "reason": "",
                              "agent_id": "agent", "num_turns": 2,
                              "messages": [{"role": "user", "content": f"question {g}"},
                                           {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                                           {"role": "tool", "content": "result", "name": "search",
                                            "tool_call_id": "call_1_0"},
                                           {"role": "assistant", "content": "<answer>42</answer>"}],
                              "response_text": "", "timings": {"total_s": 1.0}, "info": {},
                              "metadata": {"index": g * 8 + k}})
            f.write(json.dumps({"group_index": g, "task_id": f"t{g}", "env_id": "Search-v0", "accepted": True,
                                "trajectories": trajs}) + "\n")
    return directory


def browser_times(page: Path) -> dict[str, float]:
    d = browser()
    try:
        t = time.perf_counter()
        open_page(d, page)
        ready = time.perf_counter() - t
        t = time.perf_counter()
        d.execute_script("document.querySelector('#episodes tbody tr:nth-child(2)').click();"
                         "document.querySelector('[data-tab=tokens]').click();")
        d.find_element("css selector", "#strip .tok")
        tokens = time.perf_counter() - t
        t = time.perf_counter()
        d.execute_script("const s = document.getElementById('f-status'); s.value = 'failed';"
                         "s.dispatchEvent(new Event('change'));")
        d.find_element("css selector", "#episodes tbody tr")
        filt = time.perf_counter() - t
        rows = d.execute_script("return document.querySelectorAll('#episodes tbody tr').length")
        return {"ready_s": ready, "tokens_s": tokens, "filter_s": filt, "rows": rows}
    finally:
        d.quit()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=10000)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_store(Path(tmp), args.episodes, args.tokens)
        size_mb = (directory / "groups.jsonl").stat().st_size / 1e6
        t = time.perf_counter()
        for line in (directory / "groups.jsonl").open():
            json.loads(line)
        floor = time.perf_counter() - t
        t = time.perf_counter()
        page, loaded = build_view(directory)
        build = time.perf_counter() - t
        page_mb = page.stat().st_size / 1e6
        paged = browser_times(page)
        # Baseline: the same page with every row in the DOM at once.
        eager = directory / "eager.html"
        eager.write_text(page.read_text().replace("const PAGE = 100;", "const PAGE = 1e9;"))
        all_rows = browser_times(eager)
    print(f"store: {args.episodes} episodes x {args.tokens} response tokens, groups.jsonl {size_mb:.1f} MB; "
          f"page {page_mb:.1f} MB")
    print(f"{'step':34s} {'viewer':>10s} {'baseline':>10s} {'ratio':>7s}")
    print(f"{'build page (python) vs json.loads':34s} {build:9.2f}s {floor:9.2f}s {build / floor:6.1f}x")
    for key, label in (("ready_s", "open page until ready"), ("tokens_s", "open an episode's token strip"),
                       ("filter_s", "filter the list (status)")):
        print(f"{label + ' (paged vs all rows)':34s} {paged[key]:9.2f}s {all_rows[key]:9.2f}s "
              f"{all_rows[key] / max(paged[key], 1e-9):6.1f}x")
    print(f"rows in the DOM after filtering: {paged['rows']} (paged) vs {all_rows['rows']} (all rows)")


if __name__ == "__main__":
    main()
