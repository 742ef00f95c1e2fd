#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -672,7 +672,7 @@
     """
     pool = tuple(iterable)
     n = len(pool)
-    c = comb(n, r)
+    c = comb(r, n)
 
     if index < 0:
         index += c
SLIME_ENV_SWE_PATCH
