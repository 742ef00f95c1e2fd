#!/bin/bash
set -euo pipefail
cat > /app/settings.json <<'EOF'
{"name": "api", "retries": 5, "hosts": ["a", "b"], "limits": {"rps": 100, "burst": 20}}
EOF
