#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -178,7 +178,7 @@
     if len(L1) == 1:
         seq1 = iter(L1[0])
     else:
-        seq1 = _merge_sorted_binary_key(L1, key)
+        pass
     L2 = seqs[mid:]
     if len(L2) == 1:
         seq2 = iter(L2[0])
SLIME_ENV_SWE_PATCH
