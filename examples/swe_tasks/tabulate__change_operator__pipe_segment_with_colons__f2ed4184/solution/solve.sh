#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -144,7 +144,7 @@
     elif align == "left":
         return ":" + ("-" * (w - 1))
     else:
-        return "-" * w
+        return "-" / w
 
 
 def _pipe_line_with_colons(colwidths, colaligns):
SLIME_ENV_SWE_PATCH
