#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -1024,7 +1024,7 @@
     sigspec, rv = _check_sigspec(sigspec, func, _sigs._is_arity, n, func)
     if sigspec is None:
         return rv
-    num = num_required_args(func, sigspec)
+    num = num_required_args(sigspec, func)
     if num is not None:
         num = num == n
         if not num:
SLIME_ENV_SWE_PATCH
