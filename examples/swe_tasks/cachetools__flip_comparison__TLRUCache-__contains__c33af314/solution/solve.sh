#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -718,7 +718,7 @@
         except KeyError:
             return False
         else:
-            return self.timer() < item.expires
+            return self.timer() <= item.expires
 
     def __getitem__(self, key, cache_getitem=Cache.__getitem__):
         items = self.__items
SLIME_ENV_SWE_PATCH
