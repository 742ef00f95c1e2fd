#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -3009,7 +3009,7 @@
             outfile = value
         elif opt in ["-F", "--float"]:
             floatfmt = value
-        elif opt in ["-I", "--int"]:
+        elif opt not in ["-I", "--int"]:
             intfmt = value
         elif opt in ["-C", "--colalign"]:
             colalign = value.split()
SLIME_ENV_SWE_PATCH
