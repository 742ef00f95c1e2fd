#!/bin/bash
set -euo pipefail
cd /app
ln -sfn releases/v2 current
ln -sfn logs/app-2.log latest.log
