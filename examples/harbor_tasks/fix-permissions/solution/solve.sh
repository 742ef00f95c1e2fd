#!/bin/bash
set -euo pipefail
chmod 755 /app/bin/run.sh
chmod 600 /app/secrets/key.txt
chmod 700 /app/secrets
chmod 664 /app/shared/notes.txt
