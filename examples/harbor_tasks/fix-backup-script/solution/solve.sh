#!/bin/bash
set -euo pipefail
cat > /app/backup.sh <<'EOF'
#!/bin/bash
SRC=$1
DEST=$2
mkdir -p -- "$DEST"
count=0
for f in "$SRC"/*; do
  [ -f "$f" ] || continue
  cp -- "$f" "$DEST/"
  count=$((count + 1))
done
echo "copied $count files"
EOF
chmod +x /app/backup.sh
