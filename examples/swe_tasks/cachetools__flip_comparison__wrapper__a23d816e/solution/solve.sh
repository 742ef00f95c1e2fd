#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_cachedmethod.py b/src/cachetools/_cachedmethod.py
--- a/src/cachetools/_cachedmethod.py
+++ b/src/cachetools/_cachedmethod.py
@@ -102,7 +102,7 @@
 
 def _wrapper(method, cache, key, lock=None, cond=None, info=None):
     if info is not None:
-        if cond is not None and lock is not None:
+        if cond is not None and lock is None:
             wrapper = lambda obj, descriptor: _ConditionInfoWrapper(
                 obj, descriptor, method, cache, key, lock, cond, info
             )
SLIME_ENV_SWE_PATCH
