#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -134,9 +134,9 @@
 
     def get(self, key, default=None):
         if key in self:
+            return default
+        else:
             return self[key]
-        else:
-            return default
 
     def pop(self, key, default=__marker):
         if key in self:
SLIME_ENV_SWE_PATCH
