#!/bin/bash
set -euo pipefail
sed -e "s/^DB_HOST=.*/DB_HOST=$NEW_DB_HOST/" -e "s/^DB_PORT=.*/DB_PORT=$NEW_DB_PORT/" -e 's/^DEBUG=.*/DEBUG=false/' \
    /app/.env.example > /app/.env
