#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -957,12 +957,12 @@
     key = kwargs.get('key', None)
     if key is None:
         for items in iters:
-            if items.count(items[0]) != N:
-                yield items
-    else:
-        for items in iters:
             vals = tuple(map(key, items))
             if vals.count(vals[0]) != N:
+                yield items
+    else:
+        for items in iters:
+            if items.count(items[0]) != N:
                 yield items
 
 
SLIME_ENV_SWE_PATCH
