#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
import collections, re
words = re.findall(r"[a-z]+", open("/app/book.txt").read().lower())
top = sorted(collections.Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))[:5]
open("/app/top_words.txt", "w").write("".join(f"{w} {c}\n" for w, c in top))
EOF
