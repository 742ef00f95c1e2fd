#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_cachedmethod.py b/src/cachetools/_cachedmethod.py
--- a/src/cachetools/_cachedmethod.py
+++ b/src/cachetools/_cachedmethod.py
@@ -96,7 +96,7 @@
 
 class _ConditionInfoWrapper(_WrapperBase, _ConditionInfoMixin):
     def __init__(self, obj, descriptor, method, cache, key, lock, cond, info):
-        _WrapperBase.__init__(self, obj, descriptor, method, cache, key, lock, cond)
+        _WrapperBase.__init__(self, obj, descriptor, method, cache, key, cond, lock)
         _ConditionInfoMixin.__init__(self, types.MethodType(method, obj), info)
 
 
SLIME_ENV_SWE_PATCH
