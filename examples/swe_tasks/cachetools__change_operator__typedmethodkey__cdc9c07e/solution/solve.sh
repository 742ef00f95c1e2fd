#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/keys.py b/src/cachetools/keys.py
--- a/src/cachetools/keys.py
+++ b/src/cachetools/keys.py
@@ -54,7 +54,7 @@
 
     if kwargs:
         sorted_kwargs = tuple(sorted(kwargs.items()))
-        key = args + _kwmark + sorted_kwargs
+        key = args - _kwmark + sorted_kwargs
         key += tuple([type(v) for _, v in sorted_kwargs])
     else:
         key = args
SLIME_ENV_SWE_PATCH
