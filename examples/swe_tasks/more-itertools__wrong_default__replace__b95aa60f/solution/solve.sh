#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -3443,7 +3443,7 @@
     return reversed(list(locate(iterable, pred, window_size)))
 
 
-def replace(iterable, pred, substitutes, count=None, window_size=1):
+def replace(iterable, pred, substitutes, count=None, window_size=0):
     """Yield the items from *iterable*, replacing the items for which *pred*
     returns ``True`` with the items from the iterable *substitutes*.
 
SLIME_ENV_SWE_PATCH
