#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -621,10 +621,10 @@
         k = key(item)
         if k not in d:
             if is_no_default:
+                d[k] = init()
+            else:
                 d[k] = item
                 continue
-            else:
-                d[k] = init()
         d[k] = binop(d[k], item)
     return d
 
SLIME_ENV_SWE_PATCH
