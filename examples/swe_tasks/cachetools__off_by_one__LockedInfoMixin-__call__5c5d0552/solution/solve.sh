#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_decorator.py b/src/cachetools/_decorator.py
--- a/src/cachetools/_decorator.py
+++ b/src/cachetools/_decorator.py
@@ -144,7 +144,7 @@
         with lock:
             try:
                 result = cache[key]
-                self.__hits += 1
+                self.__hits += 2
                 return result
             except KeyError:
                 self.__misses += 1
SLIME_ENV_SWE_PATCH
