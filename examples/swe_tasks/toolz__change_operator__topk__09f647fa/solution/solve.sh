#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -982,7 +982,7 @@
     See also:
         heapq.nlargest
     """
-    if key is not None and not callable(key):
+    if key is not None or not callable(key):
         key = getter(key)
     return tuple(heapq.nlargest(k, seq, key=key))
 
SLIME_ENV_SWE_PATCH
