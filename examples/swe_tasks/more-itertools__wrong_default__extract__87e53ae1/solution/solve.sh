#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -5418,7 +5418,7 @@
             next_to_emit += 1
 
 
-def extract(iterable, indices, *, monotonic=False):
+def extract(iterable, indices, *, monotonic=True):
     """Yield values at the specified indices.
 
     Example:
SLIME_ENV_SWE_PATCH
