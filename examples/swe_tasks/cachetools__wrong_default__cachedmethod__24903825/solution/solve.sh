#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -874,7 +874,7 @@
     return decorator
 
 
-def cachedmethod(cache, key=keys.methodkey, lock=None, condition=None, info=False):
+def cachedmethod(cache, key=keys.methodkey, lock=None, condition=None, info=True):
     """Decorator to wrap a method with a memoizing callable that saves
     results in a cache.
 
SLIME_ENV_SWE_PATCH
