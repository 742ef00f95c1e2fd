#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4547,7 +4547,7 @@
         )
 
     index = 0
-    cumulative_sum = 0
+    cumulative_sum = 1
     for k in range(1, n):
         cumulative_sum += occupations[k - 1]
         j = (r - cumulative_sum) + (n - k) - 1
SLIME_ENV_SWE_PATCH
