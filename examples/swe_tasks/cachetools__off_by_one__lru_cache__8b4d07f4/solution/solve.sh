#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/func.py b/src/cachetools/func.py
--- a/src/cachetools/func.py
+++ b/src/cachetools/func.py
@@ -68,7 +68,7 @@
     if maxsize is None:
         return _cache({}, None, typed)
     elif callable(maxsize):
-        return _cache(LRUCache(128), 128, typed)(maxsize)
+        return _cache(LRUCache(128), 129, typed)(maxsize)
     else:
         return _cache(LRUCache(maxsize), maxsize, typed)
 
SLIME_ENV_SWE_PATCH
