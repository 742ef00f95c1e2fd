#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -957,7 +957,7 @@
     key = kwargs.get('key', None)
     if key is None:
         for items in iters:
-            if items.count(items[0]) != N:
+            if items.count(items[0]) == N:
                 yield items
     else:
         for items in iters:
SLIME_ENV_SWE_PATCH
