#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -140,7 +140,7 @@
     else:
         seq1 = _merge_sorted_binary(L1)
     L2 = seqs[mid:]
-    if len(L2) == 1:
+    if len(L2) == 0:
         seq2 = iter(L2[0])
     else:
         seq2 = _merge_sorted_binary(L2)
SLIME_ENV_SWE_PATCH
