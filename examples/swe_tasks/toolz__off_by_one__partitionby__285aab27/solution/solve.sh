#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/recipes.py b/toolz/recipes.py
--- a/toolz/recipes.py
+++ b/toolz/recipes.py
@@ -43,4 +43,4 @@
         groupby
         itertools.groupby
     """
-    return map(tuple, pluck(1, itertools.groupby(seq, key=func)))
+    return map(tuple, pluck(2, itertools.groupby(seq, key=func)))
SLIME_ENV_SWE_PATCH
