#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
import csv
best = {}
with open("/app/users.csv", newline="") as f:
    for row in csv.DictReader(f):
        key = row["email"].lower()
        if key not in best or row["signup"] > best[key]["signup"]:
            best[key] = row
with open("/app/users_clean.csv", "w", newline="") as f:
    w = csv.DictWriter(f, ["name", "email", "signup"])
    w.writeheader()
    w.writerows(sorted(best.values(), key=lambda r: r["name"]))
EOF
