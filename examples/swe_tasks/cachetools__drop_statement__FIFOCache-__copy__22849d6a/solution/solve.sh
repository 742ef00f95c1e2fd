#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -203,7 +203,6 @@
         del self.__order[key]
 
     def __copy__(self):
-        copy = super().__copy__()
         copy.__order = self.__order.copy()
         return copy
 
SLIME_ENV_SWE_PATCH
