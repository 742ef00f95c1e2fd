#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -1555,6 +1555,8 @@
     iterator = takewhile(len, (seq[i : i + n] for i in count(0, n)))
     if strict:
 
+        return iterator
+    else:
         def ret():
             for _slice in iterator:
                 if len(_slice) != n:
@@ -1562,8 +1564,6 @@
                 yield _slice
 
         return ret()
-    else:
-        return iterator
 
 
 def split_at(iterable, pred, maxsplit=-1, keep_separator=False):
SLIME_ENV_SWE_PATCH
