#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4574,7 +4574,7 @@
     """
     index = 0
     pool = list(iterable)
-    for i, x in zip(range(len(pool), -1, -1), element):
+    for i, x in zip(range(len(pool) + 1, -1, -1), element):
         r = pool.index(x)
         index = index * i + r
         del pool[r]
SLIME_ENV_SWE_PATCH
