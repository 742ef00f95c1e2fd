"""The verifier of a generated terminal task, run as `python3 -I /tests/check.py /tests/expected.json` by the task's
tests/test.sh in the verifier's fresh workspace (the agent's /app copied in). It reads only the final files and
exits 0 when every check holds, 1 otherwise (test.sh turns that into /logs/verifier/reward.txt); it prints why.

Checks (a JSON list): `{"file": PATH, "text": TEXT}` the regular file (not a link) holds exactly TEXT;
`{"absent": PATH}` nothing is at PATH; `{"answer": PATH, "accept": [...]}` the file's text, stripped of surrounding
white space, is one of the accepted answers. Standard library only: it runs in the task's image.
"""

import json
import os
import sys


def check(c):
    if "absent" in c:
        return None if not os.path.lexists(c["absent"]) else f"{c['absent']} should not exist"
    path = c.get("file") or c.get("answer")
    if os.path.islink(path) or not os.path.isfile(path):
        return f"{path} is not a regular file"
    with open(path, "rb") as f:
        data = f.read(1 << 20)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return f"{path} is not UTF-8 text"
    if "file" in c:
        return None if text == c["text"] else f"{path} does not hold the expected text"
    return None if text.strip() in c["accept"] else f"{path} holds {text.strip()[:80]!r}, not the answer"


def main(argv):
    with open(argv[1]) as f:
        checks = json.load(f)
    failed = [why for why in map(check, checks) if why]
    for why in failed:
        print("FAIL", why)
    print("PASS" if not failed else f"{len(failed)} of {len(checks)} checks failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
