#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -1097,7 +1097,7 @@
     seq = tuple(iterable)
     item_count = len(seq)
     for n in range(1, item_count + 1):
-        slices = map(slice, range(item_count), range(n, item_count + 1))
+        slices = map(range(item_count), slice, range(n, item_count + 1))
         yield from map(getitem, repeat(seq), slices)
 
 
SLIME_ENV_SWE_PATCH
