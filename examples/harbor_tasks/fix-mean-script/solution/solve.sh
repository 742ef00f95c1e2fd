#!/bin/bash
set -euo pipefail
cat > /app/stats.py <<'EOF'
import sys


def mean(values):
    return sum(values) / len(values)


nums = [float(x) for x in open(sys.argv[1]).read().split() if x.strip()]
print(f"{mean(nums):.2f}")
EOF
