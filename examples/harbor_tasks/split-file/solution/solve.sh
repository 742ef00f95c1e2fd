#!/bin/bash
set -euo pipefail
mkdir -p /app/parts
split -l 100 -d -a 3 --additional-suffix=.txt /app/big.txt /app/parts/part-
