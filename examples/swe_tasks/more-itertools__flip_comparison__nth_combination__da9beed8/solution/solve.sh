#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -682,7 +682,7 @@
     result = []
     while r:
         c, n, r = c * r // n, n - 1, r - 1
-        while index >= c:
+        while index > c:
             index -= c
             c, n = c * (n - r) // n, n - 1
         result.append(pool[-1 - n])
SLIME_ENV_SWE_PATCH
