#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
import json
totals = {}
for order in json.load(open("/app/orders.json")):
    totals[order["customer"]] = totals.get(order["customer"], 0) + sum(i["qty"] * i["price"] for i in order["items"])
json.dump({k: round(v, 2) for k, v in sorted(totals.items())}, open("/app/summary.json", "w"))
EOF
