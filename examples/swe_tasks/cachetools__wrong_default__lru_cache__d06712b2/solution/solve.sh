#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/func.py b/src/cachetools/func.py
--- a/src/cachetools/func.py
+++ b/src/cachetools/func.py
@@ -59,7 +59,7 @@
         return _cache(LFUCache(maxsize), maxsize, typed)
 
 
-def lru_cache(maxsize=128, typed=False):
+def lru_cache(maxsize=128, typed=True):
     """Decorator to wrap a function with a memoizing callable that saves
     up to `maxsize` results based on a Least Recently Used (LRU)
     algorithm.
SLIME_ENV_SWE_PATCH
