#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -2625,7 +2625,7 @@
     if not linefmt:
         return None
     if callable(linefmt):
-        return linefmt(colwidths, colaligns)
+        return linefmt(colaligns, colwidths)
     else:
         begin, fill, sep, end = linefmt
         cells = [fill * w for w in colwidths]
SLIME_ENV_SWE_PATCH
