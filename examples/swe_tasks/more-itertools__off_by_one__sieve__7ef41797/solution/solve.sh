#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -923,7 +923,7 @@
     start = 3
     data = bytearray((0, 1)) * (n // 2)
     for p in iter_index(data, 1, start, stop=isqrt(n) + 1):
-        yield from iter_index(data, 1, start, p * p)
+        yield from iter_index(data, 2, start, p * p)
         data[p * p : n : p + p] = bytes(len(range(p * p, n, p + p)))
         start = p * p
     yield from iter_index(data, 1, start)
SLIME_ENV_SWE_PATCH
