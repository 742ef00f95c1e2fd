#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_cached.py b/src/cachetools/_cached.py
--- a/src/cachetools/_cached.py
+++ b/src/cachetools/_cached.py
@@ -66,7 +66,7 @@
 
 class _ConditionWrapper(_WrapperBase, _ConditionMixin):
     def __init__(self, func, cache, key, lock, cond):
-        _WrapperBase.__init__(self, func, cache, key, lock, cond)
+        _WrapperBase.__init__(self, func, cache, lock, key, cond)
         _ConditionMixin.__init__(self, func)
 
 
SLIME_ENV_SWE_PATCH
