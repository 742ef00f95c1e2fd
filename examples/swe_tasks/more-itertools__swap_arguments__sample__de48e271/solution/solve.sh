#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4041,7 +4041,7 @@
 
     elif counts is not None:
         counts = iter(counts)
-        return _sample_counted(iterator, k, counts, strict)
+        return _sample_counted(k, iterator, counts, strict)
 
     else:
         return _sample_unweighted(iterator, k, strict)
SLIME_ENV_SWE_PATCH
