#!/bin/bash
set -euo pipefail
printf '[server]\nhost = 0.0.0.0\nport = 8080\n\n[database]\nurl = postgres://db:5432/app\npool = 5\n' > /app/service.ini
