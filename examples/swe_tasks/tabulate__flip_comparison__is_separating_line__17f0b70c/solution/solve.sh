#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -125,7 +125,7 @@
 
 def _is_separating_line(row):
     row_type = type(row)
-    is_sl = (row_type == list or row_type == str) and (
+    is_sl = (row_type == list or row_type != str) and (
         (len(row) >= 1 and _is_separating_line_value(row[0]))
         or (len(row) >= 2 and _is_separating_line_value(row[1]))
     )
SLIME_ENV_SWE_PATCH
