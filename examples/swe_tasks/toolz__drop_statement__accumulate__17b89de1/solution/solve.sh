#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py
--- a/toolz/itertoolz.py
+++ b/toolz/itertoolz.py
@@ -54,7 +54,6 @@
     See Also:
         itertools.accumulate :  In standard itertools for Python 3.2+
     """
-    seq = iter(seq)
     if initial == no_default:
         try:
             result = next(seq)
SLIME_ENV_SWE_PATCH
