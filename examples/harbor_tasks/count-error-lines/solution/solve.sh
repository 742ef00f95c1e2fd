#!/bin/bash
set -euo pipefail
find /app/logs -name '*.log' -type f -exec cat {} + | grep -cw ERROR > /app/error_count.txt
