#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -267,7 +267,7 @@
         root = self.__root
         link = root.next
         if link.count != 1:
-            link = LFUCache._Link(1)
+            link = LFUCache._Link(2)
             link.next = root.next
             root.next = link.next.prev = link
             link.prev = root
SLIME_ENV_SWE_PATCH
