#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -2488,7 +2488,7 @@
         # yields 0.30000000000000004, which leaves a non-zero remainder.
         # So compare against the item the range actually produces there.
         for candidate in (i, i + 1):
-            if 0 <= candidate < self._len:
+            if 0 < candidate < self._len:
                 if self._start + candidate * self._step == value:
                     return candidate
 
SLIME_ENV_SWE_PATCH
