#!/bin/bash
set -euo pipefail
awk '!seen[$0]++' /app/list.txt > /app/list.txt.new && mv /app/list.txt.new /app/list.txt
