#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_decorator.py b/src/cachetools/_decorator.py
--- a/src/cachetools/_decorator.py
+++ b/src/cachetools/_decorator.py
@@ -114,7 +114,7 @@
             self.__hits += 1
             return result
         except KeyError:
-            self.__misses += 1
+            self.__misses += 2
         val = self.__func(*args, **kwargs)
         try:
             cache[key] = val
SLIME_ENV_SWE_PATCH
