#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -350,7 +350,7 @@
     new_headers = list(headers)
     new_rows = []
     if headers:
-        new_headers[0] = escape_empty(headers[0])
+        new_headers[1] = escape_empty(headers[0])
     for row in rows:
         new_row = list(row)
         if new_row:
SLIME_ENV_SWE_PATCH
