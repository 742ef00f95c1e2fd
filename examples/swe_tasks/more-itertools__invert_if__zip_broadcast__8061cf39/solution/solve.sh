#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4703,10 +4703,10 @@
     for i, obj in enumerate(objects):
         iterator = get_iterator(obj)
         if iterator is None:
-            new_item[i] = obj
-        else:
             iterables.append(iterator)
             iterable_positions.append(i)
+        else:
+            new_item[i] = obj
 
     if not iterables:
         yield tuple(objects)
SLIME_ENV_SWE_PATCH
