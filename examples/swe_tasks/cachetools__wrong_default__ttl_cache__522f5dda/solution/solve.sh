#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/func.py b/src/cachetools/func.py
--- a/src/cachetools/func.py
+++ b/src/cachetools/func.py
@@ -87,7 +87,7 @@
         return _cache(RRCache(maxsize, choice), maxsize, typed)
 
 
-def ttl_cache(maxsize=128, ttl=600, timer=time.monotonic, typed=False):
+def ttl_cache(maxsize=128, ttl=600, timer=time.monotonic, typed=True):
     """Decorator to wrap a function with a memoizing callable that saves
     up to `maxsize` results based on a Least Recently Used (LRU)
     algorithm with a per-item time-to-live (TTL) value.
SLIME_ENV_SWE_PATCH
