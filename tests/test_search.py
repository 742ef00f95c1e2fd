"""Search-v0 and its retrievers: BM25 and dense retrieval on real corpora, index round trips, the
Search-R1-compatible server (real HTTP on 127.0.0.1), the env with the ScriptedPolicy, loaders, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest

import slime_env
from slime_env.envs.search import (BM25Retriever, DenseRetriever, Passage, RemoteRetriever, SearchReward, demo_corpus,
                         demo_questions, exact_match, f1_score, load_retriever, load_search_tasks, read_corpus,
                         substring_exact_match, write_corpus)
from slime_env.envs.search.env import INVALID_ACTION
from slime_env.envs.search.server import make_app
from slime_env import ScriptedPolicy, get_renderer, run_episode
from slime_env.errors import InvalidInput
from helpers import LocalServer

FACTS = [("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889."),
         ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
         ("Python (language)", "Python is a programming language created by Guido van Rossum, first released in 1991."),
         ("Great Wall", "The Great Wall of China is a series of fortifications built across northern China."),
         ("Photosynthesis", "Photosynthesis converts light energy into chemical energy stored in glucose."),
         ("Amazon River", "The Amazon River in South America is the largest river by discharge volume."),
         ("Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci, kept at the Louvre.")]
CORPUS = [Passage(str(i), f"\"{t}\"\n{x}") for i, (t, x) in enumerate(FACTS)]
QUERIES = [("who created the python programming language", "2"), ("highest mountain on earth", "1"),
           ("painting by leonardo da vinci in the louvre", "6"), ("largest river discharge", "5")]


@pytest.fixture(scope="module")
def bm25_dir(tmp_path_factory):
    return BM25Retriever.build(CORPUS, tmp_path_factory.mktemp("bm25"))


def test_bm25_finds_the_known_passage_and_survives_a_save_load_round_trip(runner, bm25_dir):
    retriever = load_retriever(bm25_dir)
    assert isinstance(retriever, BM25Retriever)
    hits = runner.run(retriever.search([q for q, _ in QUERIES], topk=3))
    assert [row[0][0].id for row in hits] == [pid for _, pid in QUERIES]
    assert all(row[0][1] > row[1][1] for row in hits if len(row) > 1)  # best first
    again = runner.run(BM25Retriever(bm25_dir).search([q for q, _ in QUERIES], topk=3))
    assert ([[(p.id, round(s, 5)) for p, s in row] for row in hits]
            == [[(p.id, round(s, 5)) for p, s in row] for row in again])
    assert runner.run(retriever.search(["the of and"], topk=3)) == [[]]  # stop words only: no match, no error


def test_bm25_on_the_demo_corpus(runner, tmp_path):
    retriever = BM25Retriever(BM25Retriever.build(demo_corpus(), tmp_path / "demo"))
    questions = demo_questions(60)
    hits = runner.run(retriever.search([q["question"] for q in questions], topk=3))
    found = sum(any(p.id == q["passage_id"] for p, _ in row) for q, row in zip(questions, hits))
    assert found / len(questions) >= 0.9


def test_dense_retrieval_with_the_offline_minilm(runner, tmp_path):
    retriever = DenseRetriever(DenseRetriever.build(CORPUS, tmp_path / "dense"))
    paraphrases = [("which language did van Rossum design", "2"), ("tallest peak in the world", "1"),
                   ("how plants turn sunlight into sugar", "4")]
    hits = runner.run(retriever.search([q for q, _ in paraphrases], topk=2))
    assert [row[0][0].id for row in hits] == [pid for _, pid in paraphrases]
    assert load_retriever(tmp_path / "dense").encoder is not None


def test_concurrent_searches_are_batched(runner, bm25_dir):
    retriever = BM25Retriever(bm25_dir)

    async def main():
        return await asyncio.gather(*(retriever.search([q], topk=1 + i % 3) for i, (q, _) in enumerate(QUERIES * 10)))

    results = runner.run(main())
    assert retriever.batches < 10  # 40 calls in flight at once -> a few batches
    assert [row[0][0][0].id for row in results] == [pid for _, pid in QUERIES * 10]
    assert all(len(row[0]) <= 1 + i % 3 for i, row in enumerate(results))  # each call keeps its own topk


def test_server_speaks_search_r1(runner, bm25_dir):
    retriever = BM25Retriever(bm25_dir)

    async def main():
        async with LocalServer(make_app(retriever)) as srv, aiohttp.ClientSession() as http:
            async def post(body):
                async with http.post(f"{srv.url}/retrieve", json=body) as r:
                    return r.status, await r.json()

            scored = await post({"queries": ["highest mountain", "python language creator"], "topk": 2,
                                 "return_scores": True})
            bare = await post({"queries": ["highest mountain"], "topk": 1})
            bad = [await post(b) for b in ({"queries": "x"}, {"queries": ["x"], "topk": 0},
                                           {"queries": ["x"], "return_scores": "yes"}, [1, 2])]
            before = retriever.batches
            many = await asyncio.gather(*(post({"queries": [q], "topk": 1}) for q, _ in QUERIES * 5))
            remote = RemoteRetriever(srv.url)
            via_client = await remote.search(["painting by leonardo"], topk=1)
            await remote.close()
            return scored, bare, bad, retriever.batches - before, many, via_client

    scored, bare, bad, batches, many, via_client = runner.run(main())
    # BM25 returns the passages that match (at most topk): Search-R1's pyserini BM25 does the same.
    assert scored[0] == 200 and len(scored[1]["result"]) == 2 and 1 <= len(scored[1]["result"][0]) <= 2
    assert scored[1]["result"][1][0]["document"]["id"] == "2"
    first = scored[1]["result"][0][0]
    assert set(first) == {"document", "score"} and first["document"] == {"id": "1", "contents": CORPUS[1].contents}
    assert bare[1] == {"result": [[{"id": "1", "contents": CORPUS[1].contents}]]}
    assert [b[0] for b in bad] == [400, 400, 400, 400]
    assert "'queries'" in bad[0][1]["error"] and "'topk'" in bad[1][1]["error"]
    assert all(status == 200 for status, _ in many) and batches < 20
    assert via_client[0][0][0].id == "6" and via_client[0][0][1] > 0


def test_rewards():
    assert exact_match("The  Eiffel tower!", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["eiffel tower"]) == 0.0
    assert substring_exact_match("it is the Eiffel Tower in Paris", "Eiffel Tower") == 1.0
    assert f1_score("eiffel tower paris", ["eiffel tower"]) == pytest.approx(0.8)
    assert SearchReward("em", format_score=0.1)("wrong", ["right"]) == 0.1
    assert SearchReward("em", format_score=0.1)(None, ["right"]) == 0.0
    with pytest.raises(ValueError, match="unknown metric"):
        SearchReward("bleu")


def _episode(runner, tok, replies, golds, retriever, **kw):
    env = slime_env.make("Search-v0", retriever=retriever, **kw)
    return runner.run(run_episode(env, ScriptedPolicy(tok, replies), {"prompt": "Who created Python?", "label": golds},
                                  renderer=get_renderer(tok), max_turns=6)), env


def test_search_then_answer(runner, smollm2_tok, bm25_dir):
    retriever = BM25Retriever(bm25_dir)
    replies = ["<think>I should look it up.</think><search>python programming language creator</search>",
               "<think>The passage says Guido.</think><answer>Guido van Rossum</answer>"]
    right, env = _episode(runner, smollm2_tok, replies, ["Guido van Rossum"], retriever)
    assert right.status == "completed" and right.reward == 1.0 and right.num_turns == 2
    assert env.searches == ["python programming language creator"]
    inserted = smollm2_tok.decode([t for t, m in zip(right.response_ids, right.loss_mask) if m == 0])
    generated = smollm2_tok.decode([t for t, m in zip(right.response_ids, right.loss_mask) if m == 1])
    assert "<information>Doc 1(Title: \"Python (language)\") Python is a programming language" in inserted
    assert "<information>" not in generated and "Guido van Rossum</answer>" in generated
    right.check()
    wrong, _ = _episode(runner, smollm2_tok, [replies[0], "<answer>Linus Torvalds</answer>"], ["Guido van Rossum"],
                        retriever)
    assert wrong.status == "completed" and wrong.reward == 0.0


def test_generation_stops_at_the_closing_search_tag(runner, smollm2_tok, bm25_dir):
    traj, _ = _episode(runner, smollm2_tok, ["<search>mona lisa</search> and then I keep talking <answer>x</answer>",
                                             "<answer>Leonardo da Vinci</answer>"], ["Leonardo da Vinci"],
                       BM25Retriever(bm25_dir))
    first_turn = smollm2_tok.decode(traj.response_ids[traj.spans[0].start:traj.spans[0].end])
    assert first_turn.endswith("</search>") and "keep talking" not in first_turn
    assert traj.reward == 1.0


def test_invalid_action_budget_and_the_beijing_gotcha(runner, smollm2_tok, bm25_dir):
    retriever = BM25Retriever(bm25_dir)
    # The prompt's own example answer is Beijing; a model that never answers must not score it.
    traj, _ = _episode(runner, smollm2_tok, ["I am not sure what to do."], ["Beijing"], retriever, max_turns=3)
    assert "<answer> Beijing </answer>" in traj.messages[0].content
    assert traj.status == "truncated" and traj.reward == 0.0 and traj.num_turns == 3
    assert "".join(m.content for m in traj.messages).count(INVALID_ACTION) == 2  # after turns 1 and 2, not the last
    tiny, _ = _episode(runner, smollm2_tok, ["<search>eiffel tower paris</search>", "<answer>Paris</answer>"],
                       ["Paris"], retriever, observation_budget_tokens=10)
    info = smollm2_tok.decode([t for t, m in zip(tiny.response_ids, tiny.loss_mask) if m == 0])
    assert "<information>" in info and "</information>" in info and "completed in 1889" not in info
    assert tiny.reward == 1.0


def test_loaders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "nq", "prompt": [{"role": "user", "content": "Answer... Question: who wrote hamlet?\n"}],
             "ability": "fact-reasoning",
             "reward_model": {"ground_truth": {"target": ["Shakespeare"]}, "style": "rule"},
             "extra_info": {"index": 0, "split": "train"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = load_search_tasks(tmp_path / "train.parquet")[0]
    assert task.label == ["Shakespeare"] and task.messages()[0].content.startswith("Answer...")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "q?", "golden_answers": ["a", "b"]}) + "\n"
                                       + json.dumps({"answers": ["x"]}) + "\n")
    with pytest.raises(InvalidInput, match=r"qa\.jsonl:2: no 'question'"):
        load_search_tasks(tmp_path / "qa.jsonl")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"id": 1, "title": "T", "text": "body"}) + "\n{broken\n")
    with pytest.raises(InvalidInput, match=r"corpus\.jsonl:2: not valid JSON"):
        list(read_corpus(tmp_path / "corpus.jsonl"))


def test_cli_builds_an_index(tmp_path):
    write_corpus(CORPUS, tmp_path / "corpus.jsonl")
    out = subprocess.run([sys.executable, "-m", "slime_env", "search", "build-index", "--corpus",
                          str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "idx")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "wrote bm25 index of 7 passages" in out.stdout
    assert isinstance(load_retriever(tmp_path / "idx"), BM25Retriever)
    bad = subprocess.run([sys.executable, "-m", "slime_env", "search", "build-index", "--corpus", str(tmp_path / "no"),
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


# --- the demo tasks' topic split and the scripted searcher (the Search-R1 cold-start check's data) ------------------
def test_search_tasks_split_by_topic_so_no_held_out_answer_is_ever_trained_on():
    from slime_env.envs.search import search_tasks

    train, test = search_tasks(split="train"), search_tasks(split="test")
    assert len(train) + len(test) == len(search_tasks()) and len(test) >= 200
    train_topics, test_topics = {t.metadata["topic"] for t in train}, {t.metadata["topic"] for t in test}
    assert train_topics and test_topics and not train_topics & test_topics
    assert not {a for t in train for a in t.label} & {a for t in test for a in t.label}
    assert [t.id for t in search_tasks(20, seed=3, split="test")] == [t.id for t in search_tasks(20, seed=3,
                                                                                            split="test")]
    assert [t.id for t in search_tasks(20, seed=3, split="test")] != [t.id for t in search_tasks(20, seed=4,
                                                                                            split="test")]
    with pytest.raises(InvalidInput, match=r"n=100000 but .* questions on the test side"):
        search_tasks(100_000, split="test")
    with pytest.raises(InvalidInput, match="split must be"):
        search_tasks(5, split="dev")


def test_the_scripted_searcher_answers_from_the_passage_that_holds_the_sentence():
    from slime_env.envs.search import teacher_reply

    question = ('Question: Which section of the Python language reference says: "The "pass" statement is a null '
                'operation."\n<|im_end|>\n<|im_start|>assistant\n')
    first = teacher_reply(question)
    assert first.endswith('<search> The "pass" statement is a null operation. </search>')
    info = ('\n\n<information>Doc 1(Title: "Simple statements") Something else entirely, about pass and null.\n'
            'Doc 2(Title: "The "pass" statement") pass_stmt ::= "pass" The "pass" statement is a null operation. '
            'Nothing happens.\nDoc 3(Title: "Identifiers (Names)") Names.</information>\n\n')
    # Doc 2 holds the sentence: its title, not the first hit's, is the answer (a title with quotes in it kept whole)
    assert teacher_reply(question + first + info).endswith('<answer> The "pass" statement </answer>')
    assert "Doc 2" in teacher_reply(question + first + info)
    assert teacher_reply("no question here") == "<answer> unknown </answer>"


def test_the_scripted_searcher_solves_demo_questions_through_the_env(runner, smollm2_tok):
    """It sees only the context (never the label), yet with BM25 over the demo corpus it solves most questions,
    each with one search; the env counts that search in `tool_stats` (evaluation's `solved_with_tool`)."""
    from slime_env.envs.search import search_tasks, teacher_reply

    async def play(task):
        return await run_episode(slime_env.make("Search-v0"), ScriptedPolicy(smollm2_tok, teacher_reply), task,
                                 renderer=get_renderer(smollm2_tok, strict=True), max_turns=4)

    async def play_all(tasks):
        return await asyncio.gather(*(play(t) for t in tasks))

    trajs = runner.run(play_all(search_tasks(24, seed=5, split="test")))
    solved = [t for t in trajs if t.reward == 1.0]
    assert len(solved) >= 18
    assert all(t.status == "completed" and t.num_turns == 2 for t in solved)
    assert all(t.info["tool_stats"] == {"search": {"calls": 1}} and len(t.info["searches"]) == 1 for t in solved)


def test_bm25s_is_imported_with_jax_kept_off_the_gpu(tmp_path):
    """bm25s runs a JAX top-k when it is imported; JAX's first use takes 75% of a GPU. A stand-in `jax` package (JAX
    itself is not installed here) records the JAX_PLATFORMS it was imported under; afterwards the process's
    environment is as it was."""
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nSEEN = os.environ.get('JAX_PLATFORMS')\n")
    (fake / "lax.py").write_text("def top_k(x, k):\n    return x[:k]\n")
    code = ("import os\nfrom slime_env.envs.search.retrievers import _bm25s\n_bm25s()\nimport jax\n"
            "print(jax.SEEN, os.environ.get('JAX_PLATFORMS'))\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.getcwd()}"}
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "None"]
