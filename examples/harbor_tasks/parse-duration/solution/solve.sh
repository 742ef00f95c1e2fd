#!/bin/bash
set -euo pipefail
cat > /app/duration.py <<'EOF'
import re

_PATTERN = re.compile(r"(?:(\d+)d)?\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?")


def parse_duration(text):
    text = text.strip()
    m = _PATTERN.fullmatch(text)
    if not text or m is None or not any(m.groups()):
        raise ValueError(f"not a duration: {text!r}")
    d, h, mi, s = (int(g or 0) for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s
EOF
