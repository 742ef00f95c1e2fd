#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -1026,7 +1026,7 @@
         return rv
     num = num_required_args(func, sigspec)
     if num is not None:
-        num = num == n
+        num = num != n
         if not num:
             return False
     varargs = has_varargs(func, sigspec)
SLIME_ENV_SWE_PATCH
