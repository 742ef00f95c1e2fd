#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/recipes.py b/more_itertools/recipes.py
--- a/more_itertools/recipes.py
+++ b/more_itertools/recipes.py
@@ -895,17 +895,17 @@
     seq_index = getattr(iterable, 'index', None)
     if seq_index is None:
         # Slow path for general iterables
-        iterator = islice(iterable, start, stop)
-        for i, element in enumerate(iterator, start):
-            if element is value or element == value:
-                yield i
-    else:
-        # Fast path for sequences
         stop = len(iterable) if stop is None else stop
         i = start - 1
         with suppress(ValueError):
             while True:
                 yield (i := seq_index(value, i + 1, stop))
+    else:
+        # Fast path for sequences
+        iterator = islice(iterable, start, stop)
+        for i, element in enumerate(iterator, start):
+            if element is value or element == value:
+                yield i
 
 
 def sieve(n):
SLIME_ENV_SWE_PATCH
