"""A scripted Search-R1 teacher for SFT warm-up data
(`warmup.data.rollouts.policy: slime_env.envs.search:teacher_reply`).

It plays the demo corpus's questions ("Which section of the Python language reference says: "…"") the way the
task is meant to be solved: search for the quoted sentence, then answer with the title of the retrieved passage
that contains it. It sees only the context, never the gold answer; the warm-up keeps its episodes only when they
score (rejection sampling), so a retrieval miss never becomes training data.
"""

from __future__ import annotations

import re

from slime_env.envs.search.rewards import normalize_answer

_QUOTED = re.compile(r'says: "(.*)"[ \t]*$', re.MULTILINE)
_DOC = re.compile(r'Doc (\d+)\(Title: (".*?")\) (.*?)(?=\nDoc \d+\(Title: |$)', re.DOTALL)


def teacher_reply(context: str) -> str:
    """The next reply of a Search-v0 episode over the demo corpus: a `<search>` for the quoted sentence, then, once
    `<information>` follows, an `<answer>` naming the passage that contains the sentence (the best word overlap
    when none contains it whole)."""
    questions = list(_QUOTED.finditer(context))
    if not questions:
        return "<answer> unknown </answer>"
    sentence = questions[-1].group(1)
    after = context[questions[-1].end():]
    if "</information>" not in after:
        return ("<think>I need the section that contains this sentence, so I search for it.</think>\n"
                f"<search> {sentence} </search>")
    info = after[after.rfind("<information>"):after.rfind("</information>")]
    docs = _DOC.findall(info)
    if not docs:
        return "<answer> unknown </answer>"
    want = normalize_answer(sentence)
    words = set(want.split())

    def score(doc: tuple[str, str, str]) -> tuple[bool, int]:
        text = normalize_answer(doc[2])
        return want in text, len(words & set(text.split()))

    number, title, _ = max(docs, key=score)  # max keeps the first of equals: the retriever's order
    title = title[1:-1]
    return f"<think>Doc {number} contains the sentence.</think>\n<answer> {title} </answer>"
