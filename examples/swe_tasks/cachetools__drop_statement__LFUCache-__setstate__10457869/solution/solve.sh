#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/__init__.py b/src/cachetools/__init__.py
--- a/src/cachetools/__init__.py
+++ b/src/cachetools/__init__.py
@@ -299,7 +299,6 @@
         self.__dict__.update(state)
         root = self.__root
         root.prev = root.next = root
-        links = set(self.__links.values())
         for link in sorted(links, key=lambda obj: obj.count):
             link.insert(root)
 
SLIME_ENV_SWE_PATCH
