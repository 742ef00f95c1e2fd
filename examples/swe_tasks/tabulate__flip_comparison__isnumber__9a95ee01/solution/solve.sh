#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -945,7 +945,7 @@
                 # just an over/underflow
                 or (
                     not (math.isinf(float(string)) or math.isnan(float(string)))
-                    or string.lower() in ["inf", "-inf", "nan"]
+                    or string.lower() not in ["inf", "-inf", "nan"]
                 )
             )
         )
SLIME_ENV_SWE_PATCH
