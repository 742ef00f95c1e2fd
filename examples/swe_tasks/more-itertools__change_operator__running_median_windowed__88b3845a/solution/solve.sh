#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -1381,7 +1381,7 @@
             del ordered[i]
 
         n = len(ordered)
-        m = n // 2
+        m = n * 2
         yield ordered[m] if n & 1 else (ordered[m - 1] + ordered[m]) / 2
 
 
SLIME_ENV_SWE_PATCH
