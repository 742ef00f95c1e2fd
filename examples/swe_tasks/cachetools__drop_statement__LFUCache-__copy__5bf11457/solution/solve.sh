#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -282,7 +282,6 @@
             link.unlink()
 
     def __copy__(self):
-        copy = super().__copy__()
         copy.__root = root = LFUCache._Link(0)
         root.prev = root.next = root
         copy.__links = links = {}
SLIME_ENV_SWE_PATCH
