#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -3581,7 +3581,6 @@
             return
 
     min_size = min_size if min_size is not None else 0
-    max_size = max_size if max_size is not None else n
     if min_size > max_size:
         return
 
SLIME_ENV_SWE_PATCH
