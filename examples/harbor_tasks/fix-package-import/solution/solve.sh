#!/bin/bash
set -euo pipefail
printf '' > /app/shop/__init__.py
printf 'def total(values):\n    return sum(values)\n' > /app/shop/prices.py
