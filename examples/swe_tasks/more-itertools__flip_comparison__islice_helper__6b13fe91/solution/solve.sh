#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -2770,7 +2770,7 @@
             cache = deque(islice(it, -stop), maxlen=-stop)
 
             for index, item in enumerate(it):
-                if index % step == 0:
+                if index % step != 0:
                     # pop and yield the item.
                     # We don't want to use an intermediate variable
                     # it would extend the lifetime of the current item
SLIME_ENV_SWE_PATCH
