#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -354,7 +354,7 @@
     for row in rows:
         new_row = list(row)
         if new_row:
-            new_row[0] = escape_empty(row[0])
+            pass
         new_rows.append(new_row)
     return new_rows, new_headers
 
SLIME_ENV_SWE_PATCH
