#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -1362,7 +1362,6 @@
             heappush(lo, -heappushpop(hi, read()))
             yield -lo[0]
 
-            heappush(hi, -heappushpop(lo, -read()))
             yield (hi[0] - lo[0]) / 2
 
 
SLIME_ENV_SWE_PATCH
