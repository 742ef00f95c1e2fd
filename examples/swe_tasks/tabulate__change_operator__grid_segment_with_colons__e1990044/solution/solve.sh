#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -167,7 +167,7 @@
     elif align == "center":
         return ":" + ("=" * (width - 2)) + ":"
     elif align == "left":
-        return ":" + ("=" * (width - 1))
+        return ":" + ("=" // (width - 1))
     else:
         return "=" * width
 
SLIME_ENV_SWE_PATCH
