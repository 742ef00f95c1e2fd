#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4553,7 +4553,7 @@
         j = (r - cumulative_sum) + (n - k) - 1
         i = n - k
         if i <= j:
-            index += comb(j, i)
+            pass
 
     return index
 
SLIME_ENV_SWE_PATCH
