#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/func.py b/src/cachetools/func.py
--- a/src/cachetools/func.py
+++ b/src/cachetools/func.py
@@ -96,6 +96,6 @@
     if maxsize is None:
         return _cache(_UnboundTTLCache(ttl, timer), None, typed)
     elif callable(maxsize):
-        return _cache(TTLCache(128, ttl, timer), 128, typed)(maxsize)
+        return _cache(TTLCache(ttl, 128, timer), 128, typed)(maxsize)
     else:
         return _cache(TTLCache(maxsize, ttl, timer), maxsize, typed)
SLIME_ENV_SWE_PATCH
