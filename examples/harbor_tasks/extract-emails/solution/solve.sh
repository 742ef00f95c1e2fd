#!/bin/bash
set -euo pipefail
python3 - <<'EOF'
import re
text = open("/app/contacts.txt").read()
found = {m.lower() for m in re.findall(r"[A-Za-z0-9._+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}", text)}
open("/app/emails.txt", "w").write("".join(f"{e}\n" for e in sorted(found)))
EOF
