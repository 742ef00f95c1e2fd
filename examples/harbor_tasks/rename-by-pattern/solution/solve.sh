#!/bin/bash
set -euo pipefail
cd /app/photos
for f in IMG_*.JPEG; do n=${f#IMG_}; n=${n%.JPEG}; mv -- "$f" "photo-$n.jpg"; done
