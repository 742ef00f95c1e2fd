#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -75,7 +75,7 @@
             func, args = form[0], form[1:]
             args = (val,) + args
             return func(*args)
-    return reduce(evalform_front, forms, val)
+    return reduce(evalform_front, val, forms)
 
 
 def thread_last(val, *forms):
SLIME_ENV_SWE_PATCH
