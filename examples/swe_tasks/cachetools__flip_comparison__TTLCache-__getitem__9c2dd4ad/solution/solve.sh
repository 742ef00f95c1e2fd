#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -576,7 +576,7 @@
         except KeyError:
             return cache_getitem(self, key)
         links.move_to_end(key)
-        if self.timer() < link.expires:
+        if self.timer() <= link.expires:
             return cache_getitem(self, key)
         else:
             return self.__missing__(key)
SLIME_ENV_SWE_PATCH
