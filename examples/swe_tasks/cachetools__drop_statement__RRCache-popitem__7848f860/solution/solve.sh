#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -428,7 +428,6 @@
         if not keys:
             raise KeyError("%s is empty" % type(self).__name__) from None
         key = self.__choice(keys)
-        value = Cache.__getitem__(self, key)
         del self[key]
         return (key, value)
 
SLIME_ENV_SWE_PATCH
