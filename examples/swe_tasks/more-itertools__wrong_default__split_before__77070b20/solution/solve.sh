#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -1610,7 +1610,7 @@
     yield buf
 
 
-def split_before(iterable, pred, maxsplit=-1):
+def split_before(iterable, pred, maxsplit=0):
     """Yield lists of items from *iterable*, where each list ends just before
     an item for which callable *pred* returns ``True``:
 
SLIME_ENV_SWE_PATCH
