#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
import csv, re
pat = re.compile(r'^(\S+) \S+ \S+ \[([^\]]+)\] "(\S+) (\S+) [^"]*" (\d{3}) ')
with open("/app/errors.csv", "w", newline="") as out:
    w = csv.writer(out)
    w.writerow(["ip", "timestamp", "method", "path", "status"])
    for line in open("/app/access.log"):
        m = pat.match(line)
        if m and 500 <= int(m.group(5)) <= 599:
            w.writerow(m.groups())
EOF
