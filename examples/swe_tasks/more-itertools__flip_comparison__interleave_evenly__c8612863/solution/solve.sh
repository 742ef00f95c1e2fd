#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -1379,7 +1379,7 @@
         # those iterables for which the error is negative are yielded
         # ("diagonal step" in Bresenham)
         for i, e_ in enumerate(errors):
-            if e_ < 0:
+            if e_ <= 0:
                 yield next(iters_secondary[i])
                 to_yield -= 1
                 errors[i] += delta_primary
SLIME_ENV_SWE_PATCH
