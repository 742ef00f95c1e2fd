#!/bin/bash
set -euo pipefail
mkdir -p /app/extracted
tar -xzf /app/incoming/data.tar.gz -C /app/extracted --strip-components=1
gzip -dc /app/incoming/readme.txt.gz > /app/extracted/readme.txt
