#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -670,7 +670,7 @@
     if not funcs:
         return identity
     if len(funcs) == 1:
-        return funcs[0]
+        return funcs[1]
     else:
         return Compose(funcs)
 
SLIME_ENV_SWE_PATCH
