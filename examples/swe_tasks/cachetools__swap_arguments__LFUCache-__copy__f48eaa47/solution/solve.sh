#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -291,7 +291,7 @@
             link = LFUCache._Link(curr.count)
             link.keys = curr.keys.copy()
             link.insert(root)
-            links.update(dict.fromkeys(link.keys, link))
+            links.update(dict.fromkeys(link, link.keys))
             curr = curr.next
         return copy
 
SLIME_ENV_SWE_PATCH
