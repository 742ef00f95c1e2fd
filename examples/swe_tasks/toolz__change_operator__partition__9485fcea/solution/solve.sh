#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -697,7 +697,7 @@
     See Also:
         partition_all
     """
-    args = [iter(seq)] * n
+    args = [iter(seq)] / n
     if pad is no_pad:
         return zip(*args)
     else:
SLIME_ENV_SWE_PATCH
