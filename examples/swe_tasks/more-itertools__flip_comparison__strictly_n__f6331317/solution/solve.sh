#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -721,7 +721,7 @@
         ['a', 'b', 'c', 'd']
 
     """
-    if too_short is None:
+    if too_short is not None:
         too_short = lambda item_count: raise_(
             ValueError,
             f'Too few items in iterable (got {item_count})',
SLIME_ENV_SWE_PATCH
