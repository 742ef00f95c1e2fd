#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -1243,7 +1243,7 @@
         return self._get_values(value)
 
 
-def spy(iterable, n=1):
+def spy(iterable, n=0):
     """Return a 2-tuple with a list containing the first *n* elements of
     *iterable*, and an iterator with the same items as *iterable*.
     This allows you to "look ahead" at the items in the iterable without
SLIME_ENV_SWE_PATCH
