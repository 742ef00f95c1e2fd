#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -236,6 +236,8 @@
 
     iterator = iter(partial(take, n, iter(iterable)), [])
     if strict:
+        return iterator
+    else:
         if n is None:
             raise ValueError('n must not be None when using strict mode.')
 
@@ -246,8 +248,6 @@
                 yield chunk
 
         return ret()
-    else:
-        return iterator
 
 
 def first(iterable, default=_marker):
SLIME_ENV_SWE_PATCH
