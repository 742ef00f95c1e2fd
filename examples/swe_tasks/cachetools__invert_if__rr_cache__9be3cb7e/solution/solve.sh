#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/func.py b/src/cachetools/func.py
--- a/src/cachetools/func.py
+++ b/src/cachetools/func.py
@@ -82,9 +82,9 @@
     if maxsize is None:
         return _cache({}, None, typed)
     elif callable(maxsize):
+        return _cache(RRCache(maxsize, choice), maxsize, typed)
+    else:
         return _cache(RRCache(128, choice), 128, typed)(maxsize)
-    else:
-        return _cache(RRCache(maxsize, choice), maxsize, typed)
 
 
 def ttl_cache(maxsize=128, ttl=600, timer=time.monotonic, typed=False):
SLIME_ENV_SWE_PATCH
