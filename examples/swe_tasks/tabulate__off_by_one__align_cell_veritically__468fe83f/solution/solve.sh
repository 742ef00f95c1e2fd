#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -2591,7 +2591,7 @@
     if row_alignment == "bottom":
         return blank * delta_lines + text_lines
     elif row_alignment == "center":
-        top_delta = delta_lines // 2
+        top_delta = delta_lines // 1
         bottom_delta = delta_lines - top_delta
         return top_delta * blank + text_lines + bottom_delta * blank
     else:
SLIME_ENV_SWE_PATCH
