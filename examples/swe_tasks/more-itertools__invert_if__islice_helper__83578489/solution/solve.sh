#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -2743,9 +2743,9 @@
             if stop is None:
                 j = len_iter
             elif stop >= 0:
+                j = max(len_iter + stop, 0)
+            else:
                 j = min(stop, len_iter)
-            else:
-                j = max(len_iter + stop, 0)
 
             # Slice the cache
             n = j - i
SLIME_ENV_SWE_PATCH
