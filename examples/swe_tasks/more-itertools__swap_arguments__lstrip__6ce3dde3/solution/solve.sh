#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -2627,7 +2627,7 @@
     a wrapper for :func:`itertools.dropwhile`.
 
     """
-    return dropwhile(pred, iterable)
+    return dropwhile(iterable, pred)
 
 
 def rstrip(iterable, pred):
SLIME_ENV_SWE_PATCH
