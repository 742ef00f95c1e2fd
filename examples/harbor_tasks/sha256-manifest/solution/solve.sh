#!/bin/bash
set -euo pipefail
cd /app/files && find . -type f | sed 's|^\./||' | LC_ALL=C sort | xargs -d '\n' sha256sum > /app/SHA256SUMS
