#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -4291,7 +4291,7 @@
     return True
 
 
-def nth_product(index, *iterables, repeat=1):
+def nth_product(index, *iterables, repeat=0):
     """Equivalent to ``list(product(*iterables, repeat=repeat))[index]``.
 
     The products of *iterables* can be ordered lexicographically.
SLIME_ENV_SWE_PATCH
