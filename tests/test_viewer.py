"""The trajectory viewer: what it reads (bad input included) and, in a real headless Chromium, what it shows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from slime_env.viewer import build_view, render_html, token_pieces
from slime_env.viewer.data import load
from viewer_support import browser, network_requests, open_page, write_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_tok):
    directory = tmp_path_factory.mktemp("store")
    trajectories = write_store(smollm2_tok, directory)
    page, loaded = build_view(directory)
    return directory, page, loaded, trajectories


@pytest.fixture(scope="module")
def driver():
    d = browser()
    yield d
    d.quit()


# --- reading ----------------------------------------------------------------------------------------
def test_store_loads_every_trajectory_with_groups_and_advantages(store):
    _, _, loaded, t = store
    assert loaded.warnings == []
    eps = loaded.episodes
    assert [e["status"] for e in eps] == ["completed", "completed", "truncated", "failed", "completed", "completed",
                                          "completed"]
    assert [e["agent"] for e in eps[4:6]] == ["x", "o"] and eps[4]["episode_id"] == eps[5]["episode_id"]
    rewards = [1.0, 0.0, 0.0, 0.0]
    mean, std = sum(rewards) / 4, math.sqrt(sum((r - 0.25) ** 2 for r in rewards) / 4)
    assert eps[0]["advantage"] == pytest.approx((1.0 - mean) / (std + 1e-6), abs=1e-3)
    assert eps[0]["response_ids"] == t["solved"].response_ids and eps[0]["mask"] == t["solved"].loss_mask
    assert eps[3]["reason"] == "policy.generate raised RuntimeError: engine exploded on turn 2"
    assert eps[6]["drift"] == ["qwen3 template re-renders history (test note)"]


def test_bad_input_is_named_by_file_and_line_and_the_rest_is_shown(store, tmp_path):
    directory, _, _, t = store
    good = t["solved"].to_dict()
    old = {k: v for k, v in good.items() if k not in ("spans", "messages", "agent_id", "timings")}  # an older writer
    weird = {**good, "spans": [{**good["spans"][0], "kind": "speculative"}, *good["spans"][1:]]}
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([json.dumps(good), "{not json", json.dumps(old), json.dumps(weird), "[1, 2]",
                               json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1]}),
                               json.dumps(good)[:50]]))  # the writer died mid-line
    loaded = load(path)
    assert len(loaded.episodes) == 3
    assert loaded.warnings == [
        f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "skipped",
        f"{path}:3: older record format (no 'spans'); token kinds derived from the loss mask",
        f"{path}:4: unknown span kind 'speculative' (tokens 0..{good['spans'][0]['end']}); shown as 'unknown'",
        f"{path}:5: expected a JSON object, got list; skipped",
        f"{path}:6: not a trajectory (ValueError: 2 response ids but 1 mask values and 2 log-probs); skipped",
        f"{path}:7: truncated last line (the writer stopped mid-line?); skipped"]
    old_ep = loaded.episodes[1]
    assert [s[1] for s in old_ep["spans"]] == ["generated", "inserted", "generated"] and old_ep["agent"] == "agent"
    assert loaded.episodes[2]["spans"][0][1] == "unknown"

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert load(empty).warnings == [f"{empty}: empty file: no episodes"] and load(empty).episodes == []
    assert load(tmp_path / "nope")  .warnings == [f"{tmp_path / 'nope'}: no such file or directory"]


def test_parquet_rows_and_cli(store, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, _, _, t = store
    row = {"group_index": 0, "index": 0, "task_id": "x", "env_id": "Calculator-v0", "status": "completed",
           "reason": "", "reward": 1.0, "prompt_ids": t["solved"].prompt_ids, "response_ids": t["solved"].response_ids,
           "loss_mask": t["solved"].loss_mask, "rollout_logprobs": t["solved"].rollout_logprobs,
           "turn_rewards": [0.0, 1.0], "num_turns": 2}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "batch-00000.parquet")
    out = subprocess.run([sys.executable, "-m", "slime_env", "view", str(tmp_path), "--out", str(tmp_path / "v.html")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "1 episodes ->" in out.stdout and "older record format" in out.stderr
    assert (tmp_path / "v.html").stat().st_size > 1000


def test_token_pieces_show_split_characters(smollm2_tok):
    ids = smollm2_tok.encode("héllo 🙂\n漢", add_special_tokens=False)
    pieces = token_pieces(smollm2_tok, set(ids))
    assert [pieces[i] for i in ids] == ["h", "é", "llo", " 🙂", "\n", "<0xE6>", "<0xBC>", "<0xA2>"]


# --- in the browser ---------------------------------------------------------------------------------
def _rows(d):
    return d.find_elements("css selector", "#episodes tbody tr")


def _click_episode(d, i):
    d.find_element("css selector", f'#episodes tbody tr[data-i="{i}"]').click()


def _tab(d, name):
    d.find_element("css selector", f'[data-tab="{name}"]').click()


def test_page_lists_episodes_makes_no_network_request_and_filters(store, driver):
    _, page, _, _ = store
    open_page(driver, page)
    assert len(_rows(driver)) == 7
    statuses = [r.find_element("css selector", ".badge").text for r in _rows(driver)]
    assert statuses == ["completed", "completed", "truncated", "failed", "completed", "completed", "completed"]
    assert network_requests(driver) == []
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", "f-status")).select_by_value("failed")
    assert [r.get_attribute("data-i") for r in _rows(driver)] == ["3"]
    Select(driver.find_element("id", "f-status")).select_by_value("")
    Select(driver.find_element("id", "f-agent")).select_by_value("o")
    assert [r.get_attribute("data-i") for r in _rows(driver)] == ["5"]
    Select(driver.find_element("id", "f-agent")).select_by_value("")
    Select(driver.find_element("id", "f-sort")).select_by_value("length-desc")
    lengths = [int(r.find_elements("css selector", "td")[-1].text) for r in _rows(driver)]
    assert lengths == sorted(lengths, reverse=True)
    driver.find_element("id", "f-q").send_keys("engine exploded")
    assert [r.get_attribute("data-i") for r in _rows(driver)] == ["3"]
    assert driver.get_log("browser") == []  # no script error


def test_token_strip_shows_the_ledger(store, driver, smollm2_tok):
    _, page, loaded, t = store
    open_page(driver, page)
    _click_episode(driver, 0)
    _tab(driver, "tokens")
    toks = driver.find_elements("css selector", "#strip .tok")
    traj = t["solved"]
    assert [int(x.get_attribute("data-id")) for x in toks] == traj.prompt_ids + traj.response_ids
    response = toks[len(traj.prompt_ids):]
    assert [x.get_attribute("data-kind") == "generated" for x in response] == [m == 1 for m in traj.loss_mask]
    generated = [x for x in response if x.get_attribute("data-kind") == "generated"]
    lps = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if m]
    assert [float(x.get_attribute("data-lp")) for x in generated] == pytest.approx(lps, abs=1e-4)
    # Each token as the tokenizer cut it: whitespace made visible, boundaries are elements.
    text = "".join(x.text for x in response).replace("·", " ").replace("↵", "")
    assert text.replace("\n", "") == smollm2_tok.decode(traj.response_ids).replace("\n", "")
    colour = lambda x: x.value_of_css_property("background-color")  # noqa: E731
    assert colour(generated[0]) == "rgba(200, 236, 200, 1)"
    inserted = [x for x in response if x.get_attribute("data-kind") == "inserted"]
    assert inserted and colour(inserted[0]) == "rgba(221, 229, 240, 1)"
    assert "special" in toks[0].get_attribute("class")  # <|im_start|>
    driver.find_element("id", "heat").click()
    generated = [x for x in driver.find_elements("css selector", "#strip .tok")
                 if x.get_attribute("data-kind") == "generated"]
    heat = [colour(x) for x in generated]
    assert len(set(heat)) > 1 and "rgba(200, 236, 200, 1)" not in heat  # coloured by log-prob now
    assert "logprob" in generated[0].get_attribute("title")


def test_failed_truncated_drift_group_and_agents(store, driver):
    _, page, _, t = store
    open_page(driver, page)
    _click_episode(driver, 3)
    assert (driver.find_element("id", "d-reason").text
            == "policy.generate raised RuntimeError: engine exploded on turn 2")
    _tab(driver, "tokens")
    kinds = {x.get_attribute("data-kind") for x in driver.find_elements("css selector", "#strip .tok")}
    assert "masked" in kinds and "generated" not in kinds  # a failed episode never reaches the loss
    _click_episode(driver, 2)
    assert driver.find_element("id", "d-reason").text == "max_turns=2 reached"
    _click_episode(driver, 6)
    _tab(driver, "tokens")
    assert "qwen3 template re-renders history" in driver.find_element("id", "drift").text
    assert driver.find_elements("css selector", '#strip .tok[data-kind="offpolicy"]')
    _click_episode(driver, 0)
    _tab(driver, "turns")
    tool = driver.find_element("css selector", "#turns .msg.tool .role").text
    assert "tool calculator" in tool and "id call_1_0" in tool
    _tab(driver, "group")
    samples = driver.find_elements("css selector", "#group .sample")
    assert [s.find_element("css selector", ".reward").text for s in samples] == ["1", "0", "0", "0"]
    advantages = [float(s.find_element("css selector", ".advantage").text) for s in samples]
    assert advantages[0] > 0 and all(a < 0 for a in advantages[1:])
    _click_episode(driver, 4)
    _tab(driver, "agents")
    header = driver.find_element("css selector", "#agents thead").text
    assert "x" in header and "o" in header and "reward 1" in header and "reward -1" in header
    rows = driver.find_elements("css selector", "#agents tbody tr")
    assert len(rows) == 3 and "<move>5</move>" in rows[0].text and "<move>2</move>" in rows[0].text


def test_warnings_are_shown_and_a_screenshot_is_taken(store, driver, tmp_path):
    directory, _, _, _ = store
    bad = tmp_path / "bad.jsonl"
    lines = (directory / "groups.jsonl").read_text().splitlines()
    bad.write_text(lines[0] + "\n{oops\n" + lines[1][:40])
    page, loaded = build_view(bad)
    open_page(driver, page)
    assert len(_rows(driver)) == 4
    shown = [w.text for w in driver.find_elements("css selector", "#warnings li")]
    assert shown == loaded.warnings and f"{bad}:2:" in shown[0] and f"{bad}:3: truncated" in shown[1]
    shot = tmp_path / "viewer.png"
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def test_empty_input_page_says_so(driver, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    page, _ = build_view(empty, tokenizer="none")
    open_page(driver, page)
    assert driver.find_element("id", "page-info").text == "no episodes match"
    assert "empty file" in driver.find_element("id", "warnings").text


def test_html_is_self_contained(store):
    _, _, loaded, _ = store
    text = render_html(loaded, "default")
    assert "http://" not in text.split('<script id="data"')[0] and "https://" not in text.split('<script id="data"')[0]
    assert "default-src 'none'" in text and "<script src" not in text and "<link" not in text


def _fake_run(directory: Path, store_dir: Path) -> Path:
    """A run directory as `slime-env train` leaves it: metrics per step and the groups sampled at steps 1..3."""
    run = directory / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/reward_mean": 0.1}]
    for step in (1, 2, 3):
        rows.append({"step": step, "train/reward_mean": 0.2 * step, "train/kl": 0.01 * step,
                     "train/entropy": 2 - 0.1 * step, "train/clip_frac": 0.05, "train/response_len": 40 + step,
                     "train/step_s": 3.0, "rollout/s": 2.0,
                     "rollout/statuses": {"completed": 6, "truncated": 1, "failed": 1},
                     "rollout/tools/calculator/calls": 3 + step})
    rows[-1]["eval/accuracy"] = 0.5
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "config.json").write_text(json.dumps({"env": "Calculator-v0", "model": "default",
                                                 "trainer": {"estimator": "grpo"}}))
    group = json.loads((store_dir / "groups.jsonl").read_text().splitlines()[0])
    (run / "samples.jsonl").write_text("".join(json.dumps({**group, "step": s}) + "\n" for s in (1, 2, 3)))
    return run


def test_training_report_in_the_browser(store, driver, tmp_path):
    from slime_env.trainers.run.report import write_report

    directory, _, _, _ = store
    run = _fake_run(tmp_path, directory)
    out = subprocess.run([sys.executable, "-m", "slime_env", "report", str(run)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    page = run / "report.html"
    assert out.stdout.strip() == f"report: {page}"
    open_page(driver, page)
    titles = [f.text for f in driver.find_elements("css selector", "#charts figcaption")]
    assert titles == ["Reward", "Held-out accuracy", "Response length", "KL", "Entropy", "Clip fraction",
                      "Time per step", "Episode statuses", "Tool calls"]
    widths = driver.execute_script("return [...document.querySelectorAll('#charts img')].map(i => i.naturalWidth)")
    assert all(w > 200 for w in widths)  # every picture decoded
    facts = driver.find_element("id", "facts").text
    assert "held-out accuracy 0.100 → 0.500" in facts and "trajectories shown steps 1, 3" in facts
    from selenium.webdriver.support.ui import Select

    steps = [o.get_attribute("value") for o in Select(driver.find_element("id", "f-step")).options]
    assert steps == ["", "1", "3"]  # the first and the last step's trajectories only
    assert len(_rows(driver)) == 8 and network_requests(driver) == []
    driver.save_screenshot(str(tmp_path / "report.png"))
    assert write_report(run, tmp_path / "again.html").read_text().count("data:image/png") == 9
