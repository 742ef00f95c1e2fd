#!/bin/bash
set -euo pipefail
cd /app && tar --exclude='*.tmp' -czf backup.tar.gz docs
