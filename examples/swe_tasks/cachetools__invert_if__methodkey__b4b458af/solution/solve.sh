#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/keys.py b/src/cachetools/keys.py
--- a/src/cachetools/keys.py
+++ b/src/cachetools/keys.py
@@ -32,9 +32,9 @@
     """Return a cache key for use with cached methods."""
 
     if kwargs:
+        return args
+    else:
         return args + _kwmark + tuple(sorted(kwargs.items()))
-    else:
-        return args
 
 
 def typedkey(*args, **kwargs):
SLIME_ENV_SWE_PATCH
