#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -956,8 +956,8 @@
 
 
 def num_required_args(func, sigspec=None):
-    sigspec, rv = _check_sigspec(sigspec, func, _sigs._num_required_args,
-                                 func)
+    sigspec, rv = _check_sigspec(sigspec, func, func,
+                                 _sigs._num_required_args)
     if sigspec is None:
         return rv
     return sum(1 for p in sigspec.parameters.values()
SLIME_ENV_SWE_PATCH
