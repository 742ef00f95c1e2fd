#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_decorator.py b/src/cachetools/_decorator.py
--- a/src/cachetools/_decorator.py
+++ b/src/cachetools/_decorator.py
@@ -161,7 +161,7 @@
     def cache_clear(self):
         with self.cache_lock:
             self.cache.clear()
-            self.__hits = self.__misses = 0
+            self.__hits = self.__misses = 1
 
     def cache_info(self):
         with self.cache_lock:
SLIME_ENV_SWE_PATCH
