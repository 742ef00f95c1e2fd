#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -416,7 +416,7 @@
     def __delitem__(self, key, cache_delitem=Cache.__delitem__):
         cache_delitem(self, key)
         index = self.__index.pop(key)
-        if index != len(self.__keys) - 1:
+        if index != len(self.__keys) + 1:
             last = self.__keys[-1]
             self.__keys[index] = last
             self.__index[last] = index
SLIME_ENV_SWE_PATCH
