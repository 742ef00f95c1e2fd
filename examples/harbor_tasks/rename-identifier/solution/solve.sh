#!/bin/bash
set -euo pipefail
find /app/src -name '*.py' -exec sed -i -E 's/\bfoo_client\b/bar_client/g' {} +
