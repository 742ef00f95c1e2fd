#!/bin/bash
set -euo pipefail
cd /app/repo
git add README.md
git -c user.name=Dev -c user.email=dev@example.com commit -qm "Fix typo in README"
