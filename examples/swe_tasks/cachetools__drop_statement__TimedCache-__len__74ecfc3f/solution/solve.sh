#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -494,7 +494,6 @@
 
     def __len__(self, cache_len=Cache.__len__):
         with self.__timer as time:
-            self.expire(time)
             return cache_len(self)
 
     @property
SLIME_ENV_SWE_PATCH
