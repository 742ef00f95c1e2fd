#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1708,7 +1708,7 @@
                 wrapped = [
                     "\n".join(wrapper.wrap(line))
                     for line in casted_cell.splitlines()
-                    if line.strip() != ""
+                    if line.strip() == ""
                 ]
                 new_row.append("\n".join(wrapped))
             else:
SLIME_ENV_SWE_PATCH
